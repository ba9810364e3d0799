"""verl's side of `test_prime_vs_verl.py`, run in verl's interpreter: `argv[1]` a JSON file of
cases, `argv[2]` where to write verl's scores. Each case's rows are scored by verl 0.9.1's own
`run_reward_scoring` (`verl/workers/reward_manager/prime.py`) with the scorer of
`tests/trainer/prime_scorers.py` the case names."""

import importlib.util
import json
import sys
from pathlib import Path

from verl.workers.reward_manager.prime import run_reward_scoring

spec = importlib.util.spec_from_file_location("prime_scorers", Path(__file__).with_name("prime_scorers.py"))
scorers = importlib.util.module_from_spec(spec)
sys.modules["prime_scorers"] = scorers  # verl's pool pickles the function by its module's name
spec.loader.exec_module(scorers)

cases = json.loads(Path(sys.argv[1]).read_text())
out = [run_reward_scoring(getattr(scorers, c["scorer"]), c["responses"], c["truths"], c["sources"], c["infos"],
                          num_processes=4) for c in cases]
Path(sys.argv[2]).write_text(json.dumps(out))
