"""`trainer.algos.rollout_corr` against verl's own `rollout_corr_helper.py`, on random batches.

    python -m bench.rollout_corr_vs_verl --verl-git-dir DIR [--trials 40]

DIR is a verl checkout or a bare git directory (its HEAD is read). verl's module is run as it is,
with its torch helpers (`masked_sum`, `masked_mean` from `verl/utils/torch_functional.py`, copied
from the same commit) and stand-ins for the three imports it only names in signatures (`DataProto`,
the two config classes). For every `rollout_is` level, batch normalisation on and off, each
`rollout_rs` option and two chained ones, on batches of 1-9 rows x 1-17 tokens with log-ratios
from 0.01 to 30 in scale and empty rows: the masks must be equal, and the weights and every metric
equal to 1e-9 relative. Prints the count and the worst difference.
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

STUBS = {
    "verl/protocol.py": "class DataProto:\n    def __init__(self, batch):\n        self.batch = batch\n\n"
                        "    @classmethod\n    def from_dict(cls, tensors):\n        return cls(dict(tensors))\n",
    "verl/trainer/config/algorithm.py": "RolloutCorrectionConfig = dict\n",
    "verl/workers/config/actor.py": "PolicyLossConfig = dict\n",
}
RS = [(None, None), ("token_k1", 2.0), ("token_k1", "0.5_1.5"), ("token_k2", 0.1), ("token_k3", 0.05),
      ("seq_sum_k1", "0.3_3"), ("seq_sum_k2", 1.0), ("seq_sum_k3", 0.5), ("seq_mean_k1", 1.5),
      ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.02), ("seq_max_k2", 0.2), ("seq_max_k3", 0.3),
      ("token_k1,seq_mean_k3", "2.0,0.02"), ("seq_max_k2,token_k3,token_k3", 0.2)]


def show(git_dir: Path, path: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def verl_module(git_dir: Path, root: Path):  # noqa: ANN201 (verl's module)
    helpers = show(git_dir, "verl/utils/torch_functional.py")
    start, end = helpers.index("def masked_sum("), helpers.index("def masked_var(")
    files = {**STUBS, "verl/utils/torch_functional.py": "import torch\n\n" + helpers[start:end],
             "verl/trainer/ppo/rollout_corr_helper.py": show(git_dir, "verl/trainer/ppo/rollout_corr_helper.py")}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for pkg in ("verl", "verl/utils", "verl/trainer", "verl/trainer/config", "verl/trainer/ppo", "verl/workers",
                "verl/workers/config"):
        (root / pkg / "__init__.py").touch()
    sys.path.insert(0, str(root))
    return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")


def compare(verl, trials: int) -> tuple[int, float]:  # noqa: ANN001
    import torch

    from trainer.algos.rollout_corr import RolloutCorrection, correct

    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    cases, worst = 0, 0.0
    for _ in range(trials):
        for level in (None, "token", "sequence"):
            for normalise in (False, True):
                for rs, spec in RS:
                    b, t = rng.randint(1, 9), rng.randint(1, 17)
                    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
                    roll = old + torch.randn(b, t, generator=g, dtype=torch.float64) * rng.choice([0.01, 0.3, 2.0, 30.0])
                    mask = (torch.rand(b, t, generator=g) > 0.3).to(torch.float64)
                    if rng.random() < 0.3:
                        mask[0] = 0
                    if not mask.any():
                        mask[-1, 0] = 1
                    threshold = rng.choice([1.5, 2.0, 5.0])
                    vw, vmask, vm = verl.compute_rollout_correction_and_rejection_mask(
                        old, roll, mask, rollout_is=level, rollout_is_threshold=threshold,
                        rollout_is_batch_normalize=normalise, rollout_rs=rs, rollout_rs_threshold=spec)
                    ow, omask, om = correct(old, roll, mask, RolloutCorrection(level, threshold, normalise, rs, spec))
                    assert (vw is None) == (ow is None) and torch.equal(vmask, omask), (level, rs, spec)
                    if ow is not None:
                        worst = max(worst, (vw.batch["rollout_is_weights"] - ow).abs().max().item())
                    assert set(vm) == set(om), set(vm) ^ set(om)
                    for key, theirs in vm.items():
                        a, c = float(theirs), om[key]
                        if (math.isnan(a) and math.isnan(c)) or (math.isinf(a) and a == c):
                            continue
                        worst = max(worst, abs(a - c) / max(1.0, abs(a)))
                        assert abs(a - c) / max(1.0, abs(a)) < 1e-9, (key, a, c, level, rs, spec)
                    cases += 1
    return cases, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout_corr_vs_verl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl-git-dir", type=Path, required=True, help="a verl checkout's .git, or a bare repository")
    parser.add_argument("--trials", type=int, default=40, help="rounds over the 90 configurations (40)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="verl-rollout-corr-") as root:
        verl = verl_module(args.verl_git_dir, Path(root))
        cases, worst = compare(verl, args.trials)
    print(f"identical to verl's rollout_corr_helper: {cases} batches, {len(RS) * 6} configurations, "
          f"worst relative difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
