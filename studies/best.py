"""Best configuration per (backbone, loss) from MLflow alone, as a table. See --help."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from apao_ray.study.cli.sweep import best_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
