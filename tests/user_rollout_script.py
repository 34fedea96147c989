"""An RL user's own script, as one writes it: the engine's logprobs written to a file, then
tpdiag's rollout API called at top level - no `if __name__ == "__main__":` guard.
Usage: python user_rollout_script.py WORKDIR JOBS [TP degrees, default 1,2]"""
import json
import os
import sys

from tpdiag.rollout.run import RolloutConfig, run_rollout

work, jobs = sys.argv[1], int(sys.argv[2])
degrees = tuple(int(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(","))
rollout = os.path.join(work, "engine.jsonl")
with open(rollout, "w") as f:
    f.write(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6], "prompt_len": 3, "logprobs": [-0.5, -0.25, -1.0]}) + "\n")
# every process that runs this line says so: the ranks re-running it are counted by the test
with open(os.path.join(work, "ran.txt"), "a") as f:
    f.write(f"{os.getpid()}\n")

summary = run_rollout(RolloutConfig(file=rollout, model="tiny-llama", tp=degrees, micro_batch=(1,),
                                    modes=("prefill",), fixes=("none",), jobs=jobs, timeout=60))
print("RESULT " + json.dumps({k: c["status"] for k, c in summary["configurations"].items()}))
