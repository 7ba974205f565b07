"""Train one trial (dataset x backbone x loss) on Ray Train and print its final metrics as JSON.

Example:
    python studies/train.py --dataset office --backbone tiger --loss apao_pointwise --beta 0.3 --eta 1e-4
    python studies/train.py --smoke        # tiny synthetic run on CPU, about a minute
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from apao_ray.study.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
