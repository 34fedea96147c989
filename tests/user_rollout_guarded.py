"""The same RL user's script with its call under `if __name__ == "__main__":`.
Usage: python user_rollout_guarded.py WORKDIR JOBS"""
import json
import os
import sys

from tpdiag.rollout.run import RolloutConfig, run_rollout


def main(work: str, jobs: int) -> dict:
    rollout = os.path.join(work, "engine.jsonl")
    with open(rollout, "w") as f:
        f.write(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6], "prompt_len": 3, "logprobs": [-0.5, -0.25, -1.0]}) + "\n")
    summary = run_rollout(RolloutConfig(file=rollout, model="tiny-llama", tp=(1, 2), micro_batch=(1,),
                                        modes=("prefill",), fixes=("none",), jobs=jobs, timeout=60))
    return {k: c["status"] for k, c in summary["configurations"].items()}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], int(sys.argv[2]))))
