"""Did a rerun reproduce the study? Compare two run directories artifact by artifact.

    .venv/bin/python bench/compare_runs.py RUN_BEFORE RUN_AFTER [--out bench/results/compare.json]

The same as `rlxf compare` (`rlxf_utils.compare`): bytes first; tables and JSON whose bytes differ
are compared again without their timing columns and keys. The runner's records, fingerprints,
executed notebooks, rendered report, logs and resume state differ by design and are listed, not
compared. Exit status 0 when every artifact is equal (timings aside), 1 otherwise. Used to check
that the package's redesign left the smoke and default studies' artifacts unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlxf_utils.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
