"""`kronos build-qlib-store` from a source checkout: python scripts/build_qlib_data.py --out DIR ... (the code and the
folder's layout: finetune/qlib_builder.py)."""

import sys

from finetune.qlib_builder import main
from finetune.utils.errors import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))
