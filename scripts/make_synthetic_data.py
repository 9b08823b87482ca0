"""`kronos make-synthetic` from a source checkout: python scripts/make_synthetic_data.py --out DIR ... (the code and
its market model: finetune/synthetic.py)."""

import sys

from finetune.synthetic import main
from finetune.utils.errors import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))
