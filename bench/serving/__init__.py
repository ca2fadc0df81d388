"""The serving bench: Plurai against `vllm serve` instances behind `vllm-router`, on the same
engine (vLLM's CPU build), the same model, the same per-engine KV budget and cores, and the
same OpenAI requests, driven open-loop from one seeded workload file per run; and the same
policies at fleet scale, simulated. The package, a file a part: workload.py (the seeded
requests), stacks.py (the stacks it starts and stops), client.py (the load generator),
scenarios.py (a run: every scenario on every stack), report.py and figures.py (the figures
and the ratios), __main__.py (the command), simulation.py (the fleet simulation, a bench of
its own: `python -m bench.serving.simulation`).

    python -m bench.serving [--k 2] [--stacks plurai-vllm,plurai-native,round_robin,...]
        [--scenarios idle,sweep,flood,add,kill] [--duration 40] [--scales 0.3,0.6,0.9,1.3]
        [--repeats 1] [--capacity REQ_S] [--model DIR] [--dtype auto] [--bind-peers] [--out DIR]
        [--smoke]

Stacks (each started fresh, K engines, engine i bound to core i mod cores):
- plurai-vllm: a Redis, `plurai gateway`, K `plurai worker --backend vllm` with the Redis KV
  tier on a Redis of its own (PLURAI_KV_REDIS_URL: allkeys-lru, no persistence, as
  docs/operations.md deploys a cache); plurai-native: the same with the native engine;
  plurai-vllm-notier, plurai-native-notier: without the KV tier.
- round_robin, power_of_two, cache_aware (any vllm-router policy): K `vllm serve
  --scheduling-policy priority --enable-prefix-caching` behind `vllm-router --policy P`
  (`make peers` installs the router into vLLM's environment). Each engine's ranks are bound
  to its core (VLLM_CPU_OMP_THREADS_BIND, as vLLM's CPU docs run it); a Plurai worker also
  binds vLLM's engine core there (gpu_workers/vllm_backend/cores.py); --bind-peers does it
  for `vllm serve` by hand, with taskset over the whole instance.

Scenarios, run in this order on every stack, so each stack's caches see the same history
(after a burst of --warmup unmeasured requests per engine: a fresh engine's first batches
stall while kernels are built for their shapes):
- idle: a few requests one at a time on every stack; the SLOs are multiples of the first
  stack's medians (interactive: TTFT and TPOT 5x; batch: end to end 10x; --slo-*), or an
  earlier run's (--slos-from, to compare a run on fewer stacks with it). The
  routers come first by default; a Plurai stack started once the SLOs are known is given
  a top-lane TPOT target a little under the interactive one (--plurai-tpot-share), as an
  operator sets PLURAI_TOP_LANE_TPOT_MS from their objective (a router has no such knob),
  and a bound on the wait for it under the TTFT one (--plurai-wait-share,
  PLURAI_TOP_LANE_WAIT_MS: a request held past its TTFT objective misses it anyway).
- sweep: the mixed workload (interactive chats on shared system prompts, growing multi-turn
  sessions, batch-lane document extraction; gamma arrivals, --burstiness) offered at each
  --scales multiple of the calibrated capacity; goodput is the highest offered rate whose
  requests met their lane's SLO in >= 90% of cases (with --repeats R, the sweep goes round R
  times with other seeds and a load's attainment pools its rounds: one 40 s gamma run is a few
  bursts, and where they fall decides it; each round runs every stack in turn, restarting
  it, so that a slow stretch of the shared machine does not land on the last stack alone).
  The capacity (--capacity, else measured once on the first stack with a saturating burst)
  is the same for every stack.
- flood: steady interactive traffic at 0.5x capacity with a burst of batch extraction on top;
  the interactive lane's TTFT p99 is the figure.
- add: a K+1th engine started at a third of the run under 1.2x capacity, arrivals going on
  until 10 s after it carries load (at most --add-wait s after its start, the same for
  every stack: a new engine on cores its peers keep busy starts minutes slower); the seconds from
  its being ready (the worker's heartbeat, the engine's /health) to its first request (the
  worker took a job; vLLM's running gauge), counting the router's /add_worker call, which a
  router needs and a worker does not.
- kill: one engine SIGKILLed at a third of the run under 0.5x capacity; failed and lost
  requests and the seconds until completions per second are back to 80% of before.
- trace (not in the default list): a production trace's requests (--trace, any
  Mooncake-format trace; by default the conversation trace in ../shared/traces, else its
  first 500 requests in bench/traces), as many as --duration holds at the capacity, at
  each --scales multiple of the capacity: the same requests at every load, with the
  trace's own timing squeezed to that rate and its lengths times --trace-scale
  (bench/trace_replay.py: requests that share the trace's blocks share token blocks here),
  each sent as a completion of token ids; round r of --repeats replays the trace's r-th
  window. Its SLOs are the same multiples of its own first requests sent one at a time
  (with idle; `trace_slos`); goodput and prompt tokens computed over its loads, as the
  sweep's.

Every request of a run is in one seeded JSON-lines file (bench/serving/workload.py) that
every stack replays. Batch requests go to the batch lane (Plurai: `lane`; vLLM: a lower
`priority`). Figures per stack, lane and run: TTFT, TPOT and end-to-end p50/p99, SLO
attainment, failed and lost requests, prompt tokens computed and served from a cache
(the usage's cached_tokens; Plurai's worker figures also split the Redis tier's share), and
CPU seconds per process kind (engines, front: gateway or router, Redis, load generator).
The last line is one JSON object with the ISA and the ratios of plurai-vllm against the best
router policy on each target figure.

--smoke: every scenario (the trace's too) on one engine per stack, on the factory's small
random Llama (the smallest vLLM runs) in float32, with short prompts and outputs, 2 s runs,
one load of the sweep, a flood of 4, arrivals ending 1 s after an added engine carries load; by default
every stack whose programs are installed (plurai-native always; plurai-vllm with vLLM's
environment; round_robin with vllm-router), the others named in the JSON with why. A check
that the bench runs, not a measurement.
"""
