"""Runs one real vLLM engine (in this process, no engine subprocess) through a plan, for
the integration tests, which run each plan in a process of its own: a child forked from
engine_zygote.py (vLLM already imported) for an in-process plan, else this script:

    python vllm_engine.py PLAN.json RESULT.json

The plan (JSON):
    model: a model directory (tiny random-weight models written by the tests' fixture)
    connector: "none" (the engine's own prefix cache or none), "kvoff" (KvoffConnector) or
        "spec" (vLLM's OffloadingConnector with KvoffOffloadingSpec)
    extra: kv_connector_extra_config
    engine: keyword arguments of vllm.LLM (block_size, num_gpu_blocks_override, ...)
    shutdown: true to shut the engine down after the phases (EngineCore.shutdown)
    multiprocessing: true to run vLLM's default process layout instead (the engine core in a
        process of its own, the worker in another: the "mp" executor on vLLM-CPU); the result
        then has no kvoff counters, tiers or jobs (they live in the engine-core process), and
        faults do not apply
    env: environment variables to set before vLLM is imported (e.g. VLLM_CPU_OMP_THREADS_BIND)
    phases: a list of {prompts: [[token ids]], max_tokens, ignore_eos (generate max_tokens
        whatever the model samples), reset (reset_prefix_cache before),
        reset_connector (reset_prefix_cache(reset_connector=True) before: the connector's
        cache too),
        fault: null | "fail_loads" | "fail_stores" | "corrupt_loads" | "slow_transfers",
        slow_steps: engine steps a job is held back under "slow_transfers",
        abort_after_steps: N to add the prompts, run N engine steps, abort every request (as
        a client that goes away does), then step until the engine has no request left; the
        phase then has no outputs,
        idle_steps: N to run N engine steps without adding the prompts (requests of earlier
        phases the engine still holds, e.g. for a connector's store, are served); the phase
        then has no outputs,
        sync: {ready: path, go: path, timeout_s} to create the file ``ready`` before the
        phase and wait for the test to create ``go`` (the test acts meanwhile: kills or
        restarts a pool)}

Faults act on kvoff's worker in this process for one phase: "fail_loads" and "fail_stores"
report every load (store) as failed without copying (what a real failure does),
"corrupt_loads" overwrites the GPU blocks of every load after it ran, and "slow_transfers"
holds each finished job back from get_finished for the phase's slow_steps engine steps (default
2; as a GPU's DMA still running would; a fence's wait() still gets it at once), so that the
engine's next steps see jobs in flight. (Engine and worker share this process: steps are
counted at the scheduler.)

The engine runs in float32: vLLM-CPU's bf16 kernels are not batch-invariant (a request's greedy
tokens change with what it is batched with, connector or not), float32 keeps that noise far
below the logit gaps of these models, so outputs can be compared across schedules.

The result (JSON): per phase the greedy output tokens and num_cached_tokens of every prompt,
the kvoff scheduler's counters (KvoffConnector), its secondary tiers' stats when it has tiers
(after waiting for their writes), and vLLM's metrics after it; every job the
scheduler emitted (direction, group sizes, block indices, GPU block ids); the CPU pool's slot
count and bytes per GPU block.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

import kvoff.worker as kworker
from kvoff.worker import CPUBlockSpec, TransferResult

FAULT: dict[str, Any] = {"mode": None, "slow_steps": 2}
_real_transfer = kworker.OffloadingWorker.transfer_async
_real_get_finished = kworker.OffloadingWorker.get_finished


def _faulty_transfer(self, job_id, src, dst):  # type: ignore[no-untyped-def]
    mode = FAULT["mode"]
    load = isinstance(src, CPUBlockSpec)
    if (mode == "fail_loads" and load) or (mode == "fail_stores" and not load):
        self._jobs.finish(
            TransferResult(job_id, "load" if load else "store", False, 0, 0.0, "injected fault")
        )
        return False
    ok = _real_transfer(self, job_id, src, dst)
    if mode == "corrupt_loads" and load and ok:
        ids = torch.tensor(dst.block_ids, dtype=torch.int64)
        for rows in self.gpu_tensors():
            rows[ids] = torch.randint(0, 256, (len(ids), rows.shape[1]), dtype=torch.uint8)
    return ok


_real_many = kworker.OffloadingWorker.transfer_many_async


def _faulty_many(self, jobs):  # type: ignore[no-untyped-def]
    # With a fault to inject, the jobs of a call go one by one through _faulty_transfer;
    # without, the real batched submission runs (every engine test exercises it).
    if FAULT["mode"] in ("fail_loads", "fail_stores", "corrupt_loads"):
        return [_faulty_transfer(self, *job) for job in jobs]
    return _real_many(self, jobs)


STEP = [0]  # engine steps so far (counted at the scheduler)


def _slow_get_finished(self):  # type: ignore[no-untyped-def]
    done = _real_get_finished(self)
    if FAULT["mode"] != "slow_transfers":
        return done
    first_seen = self.__dict__.setdefault("_test_first_seen", {})
    out, held = [], []
    for r in done:
        step = first_seen.setdefault(r.job_id, STEP[0])
        (out if STEP[0] - step >= FAULT["slow_steps"] else held).append(r)
    for r in held:  # still pending (the queue was empty: taken above): wait() takes them
        self._jobs.finish(r)
    return out


kworker.OffloadingWorker.transfer_async = _faulty_transfer
kworker.OffloadingWorker.transfer_many_async = _faulty_many
kworker.OffloadingWorker.get_finished = _slow_get_finished


def _connector_config(plan: dict[str, Any]):  # type: ignore[no-untyped-def]
    from vllm.config import KVTransferConfig

    kind = plan["connector"]
    if kind == "none":
        return None
    extra = dict(plan.get("extra", {}))
    if kind == "kvoff":
        return KVTransferConfig(
            kv_connector="KvoffConnector",
            kv_connector_module_path="kvoff.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    extra.update(spec_name="KvoffOffloadingSpec", spec_module_path="kvoff.integrations.vllm")
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )


def _job_record(direction: str, rid: str, gpu: Any) -> dict[str, Any]:
    ids = gpu.block_ids
    return {
        "direction": direction, "request_id": rid, "group_sizes": list(gpu.group_sizes),
        "block_indices": list(gpu.block_indices),
        "gpu_block_ids": ids.tolist() if hasattr(ids, "tolist") else list(ids),
    }  # fmt: skip


def _watch_kvoff(connector: Any, jobs: list, result: dict[str, Any]) -> None:
    """Records KvoffConnector's jobs and the requests preempted with jobs in flight."""
    cls = type(connector)
    real_build, real_update = cls.build_connector_meta, cls.update_connector_output
    in_flight: dict[int, str] = {}

    def build(self, scheduler_output):  # type: ignore[no-untyped-def]
        busy = set(in_flight.values())
        result["preempted_with_jobs_in_flight"] += [
            r for r in scheduler_output.preempted_req_ids or () if r in busy
        ]
        meta = real_build(self, scheduler_output)
        for job in (*meta.load_jobs, *meta.store_jobs):
            in_flight[job.job_id] = job.request_id
            jobs.append(_job_record(job.direction, job.request_id, job.gpu))
        return meta

    def update(self, connector_output):  # type: ignore[no-untyped-def]
        meta = connector_output.kv_connector_worker_meta
        for job in getattr(meta, "reports", {}):
            in_flight.pop(job, None)
        return real_update(self, connector_output)

    cls.build_connector_meta, cls.update_connector_output = build, update
    spec = connector.spec
    result["cpu_blocks"] = spec.num_blocks
    result["bytes_per_gpu_block"] = spec.kv_bytes_per_block
    result["block_size_factor"] = spec.block_size_factor
    result["num_gpu_blocks"] = spec.kv_cache_config.num_blocks


def _watch_spec(connector: Any, jobs: list, result: dict[str, Any]) -> None:
    """Records the jobs vLLM's OffloadingConnector hands to kvoff's worker and the requests
    preempted with jobs in flight (vLLM's own bookkeeping of them)."""
    import kvoff.integrations.vllm as kv

    sched = connector.connector_scheduler
    real_build = type(sched).build_connector_meta

    def build(self, scheduler_output):  # type: ignore[no-untyped-def]
        for r in scheduler_output.preempted_req_ids or ():
            status = self._req_status.get(r)
            if status is not None and status.transfer_jobs:
                result["preempted_with_jobs_in_flight"].append(r)
        return real_build(self, scheduler_output)

    type(sched).build_connector_meta = build
    result["cpu_blocks"] = sched.manager.num_blocks
    for name, direction in (("submit_load", "load"), ("submit_store", "store")):
        real = getattr(kv.KvoffOffloadingWorker, name)

        def submit(self, job_id, src, dst, _real=real, _dir=direction):  # type: ignore[no-untyped-def]
            jobs.append(_job_record(_dir, "", dst if _dir == "load" else src))
            return _real(self, job_id, src, dst)

        setattr(kv.KvoffOffloadingWorker, name, submit)


def main(plan_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(plan_path) as fh:
        plan = json.load(fh)
    engine = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        # On the CPU backend this is the share of the machine's memory vLLM reserves and
        # checks is free at start-up; the tiny models and forced block counts need little,
        # and the default (0.92) fails whenever anything else runs on the machine.
        "gpu_memory_utilization": 0.2,
        **plan.get("engine", {}),
    }
    from vllm.v1.core.sched.scheduler import Scheduler

    real_schedule = Scheduler.schedule

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        STEP[0] += 1
        return real_schedule(self, *args, **kwargs)

    Scheduler.schedule = schedule
    llm = LLM(model=plan["model"], kv_transfer_config=_connector_config(plan), **engine)
    in_process = not plan.get("multiprocessing")
    core = llm.llm_engine.engine_core.engine_core if in_process else None
    connector = core.scheduler.connector if core is not None else None
    jobs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"phases": [], "jobs": jobs, "preempted_with_jobs_in_flight": []}
    if connector is not None and plan["connector"] == "kvoff":
        _watch_kvoff(connector, jobs, result)
    elif connector is not None and plan["connector"] == "spec":
        _watch_spec(connector, jobs, result)
    for phase in plan["phases"]:
        if "sync" in phase:  # the test acts on the world (a pool killed, restarted) first
            _handshake(phase["sync"])
        FAULT["mode"] = phase.get("fault")
        FAULT["slow_steps"] = phase.get("slow_steps", 2)
        if phase.get("reset_connector"):
            llm.reset_prefix_cache(reset_connector=True)
        elif phase.get("reset"):
            llm.reset_prefix_cache()
        params = SamplingParams(
            max_tokens=phase.get("max_tokens", 8), temperature=0.0,
            ignore_eos=phase.get("ignore_eos", False),
        )  # fmt: skip
        at_abort: dict[str, Any] | None = None
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        if "abort_after_steps" in phase:
            engine_ = llm.llm_engine
            ids = [engine_.add_request(f"abort-{len(result['phases'])}-{i}", p, params)
                   for i, p in enumerate(prompts)]  # fmt: skip
            for _ in range(phase["abort_after_steps"]):
                engine_.step()
            if connector is not None and plan["connector"] == "kvoff":
                at_abort = connector.scheduler.stats()  # the jobs the abort leaves in flight
            engine_.abort_request(ids, internal=True)
            steps = 0
            while engine_.has_unfinished_requests():
                engine_.step()
                steps += 1
                assert steps < 10_000, "the engine kept aborted requests"
            outs = []
        elif "idle_steps" in phase:  # engine steps with no new request (the prompts are ignored)
            for _ in range(phase["idle_steps"]):
                llm.llm_engine.step()
            outs = []
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        entry: dict[str, Any] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs],
            "metrics": {
                m.name: m.value
                for m in llm.get_metrics()
                if isinstance(getattr(m, "value", None), (int, float))
            },
        }
        if at_abort is not None:
            entry["kvoff_at_abort"] = at_abort
        if connector is not None and plan["connector"] == "kvoff":
            entry["kvoff"] = connector.scheduler.stats()
            tiers = connector.scheduler.tiers
            if tiers is not None:  # secondary tiers: their writes finish before the next phase
                tiers.wait()
                entry["tiers"] = tiers.stats()
        result["phases"].append(entry)
    FAULT["mode"] = None
    if plan.get("shutdown"):  # the engine's own shutdown (workers, then the scheduler)
        if core is not None:
            core.shutdown()
        else:  # the engine-core process shuts down the same way, then exits
            llm.llm_engine.engine_core.shutdown()
        result["shutdown"] = True
    with open(result_path, "w") as fh:
        json.dump(result, fh)


def _handshake(sync: dict[str, Any]) -> None:
    """Creates the file ``sync["ready"]``, then waits for the test to create ``sync["go"]``."""
    import time

    with open(sync["ready"], "w"):
        pass
    deadline = time.monotonic() + float(sync.get("timeout_s", 300))
    while not os.path.exists(sync["go"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test did not create {sync['go']} in time")
        time.sleep(0.05)


def run_plan(plan_path: str, result_path: str) -> None:
    """Runs the plan at ``plan_path`` and writes its result to ``result_path``: what this
    script does, also called in a child forked by engine_zygote.py."""
    with open(plan_path) as fh:
        plan = json.load(fh)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if plan.get("multiprocessing") else "0"
    os.environ.update(plan.get("env", {}))
    main(plan_path, result_path)


def exit_now(code: int) -> None:
    """Exits without the interpreter's teardown, which frees vLLM's whole heap object by
    object: 6 s of the 32 s an engine of the suite took on a 2-core machine (2026-11-30). The
    steps of a normal exit before that teardown still run, in its order: threading's own exit
    (thread pools told to stop, then non-daemon threads joined), then the exit handlers (vLLM's
    engine shutdown, which stops an engine-core process; kvoff's finalizers, which unlink
    shared pools and close tier files; logging's flush)."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_plan(sys.argv[1], sys.argv[2])
    exit_now(0)
