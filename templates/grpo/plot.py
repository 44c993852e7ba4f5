"""Print the reward curve of a GRPO run from its metrics.jsonl (one JSON line per step).

python templates/grpo/plot.py $AREAL_HOME/logs/$USER/EXP/TRIAL/metrics.jsonl
"""

import json
import sys

BARS = " ▁▂▃▄▅▆▇█"


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        print(f"no steps in {path}")
        return 1
    rewards = [r["reward_mean"] for r in rows]
    lo, hi = min(rewards), max(rewards)
    span = (hi - lo) or 1.0
    for r in rows:
        x = r["reward_mean"]
        bar = "█" * int(40 * (x - lo) / span + 0.5)
        print(f"step {r['step']:3d}  reward {x:5.3f}  v{r.get('weight_version', '?'):>3}  {bar}")
    spark = "".join(BARS[int((x - lo) / span * (len(BARS) - 1))] for x in rewards)
    k = min(5, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"curve {spark}   first {k}: {first:.3f}  last {k}: {last:.3f}  gain {last - first:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
