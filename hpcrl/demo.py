"""`make demo`: the main job on the embedded default.

The PPO trainer and the `local` site are not built yet, so this demo only checks the launcher
installs and imports light. It will run `hpcrl submit --site local` on a tiny model once those
exist.
"""

from __future__ import annotations

import sys


def main() -> int:
    import hpcrl.cli

    heavy = sorted(m for m in ("torch", "ray", "vllm") if m in sys.modules)
    print(f"hpcrl {hpcrl.__version__} installed; CLI loads (heavy modules imported: {heavy or 'none'}).")
    print("demo placeholder: the trainer and the `local` site are not built yet, so no job runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
