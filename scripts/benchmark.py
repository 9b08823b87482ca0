"""`kronos benchmark` from a source checkout: python scripts/benchmark.py [NAME ...] (finetune/benchmarks/)."""

import sys

from finetune.benchmarks import main
from finetune.utils.errors import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))
