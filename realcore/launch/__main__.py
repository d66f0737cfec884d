"""`python -m realcore.launch experiment=ppo-math model=tiny trainer.total_steps=5 output_dir=/tmp/run1`"""

import sys

from realcore.launch.launcher import main
from realcore.launch.process import run_and_exit

if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1:]))
