import sys
from pathlib import Path

DEFRAG = str(Path(sys.executable).with_name("defrag"))  # the `defrag` command of this environment
