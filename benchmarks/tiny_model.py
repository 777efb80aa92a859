"""Build a small random-weight Llama with a locally trained tokenizer (no downloads).

The demo and the end-to-end tests serve it with vLLM. Weights are random (seeded), so outputs
are gibberish but deterministic: greedy outputs with and without offloading must be identical,
which is what the tests compare. The default size makes recomputing a 2k-token prefix on two
CPU cores cost a few seconds while loading its KV from disk costs tens of milliseconds.

    python -m benchmarks.tiny_model OUT_DIR [--layers 8 --hidden 512 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
    "tiered key value caches keep prefixes in cpu memory and on nvme drives for reuse",
    "a long document about storage engines, eviction policies and admission rules follows",
    "pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow",
    "numbers 0123456789 and punctuation ,.;:!?()[]{} help the tokenizer cover text",
]


def build(out: Path, layers: int = 8, hidden: int = 512, heads: int = 8, kv_heads: int = 8,
          intermediate: int = 1408, vocab: int = 512, max_pos: int = 4096, seed: int = 0
          ) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    stamp = out / "tiering-model.json"
    spec = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "intermediate": intermediate, "vocab": vocab, "max_pos": max_pos, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32",
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(spec))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args()
    print(build(Path(args.out), layers=args.layers, hidden=args.hidden))


if __name__ == "__main__":
    main()
