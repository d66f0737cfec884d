"""`python -m realcore.launch experiment=ppo-math model=tiny trainer.total_steps=5 output_dir=/tmp/run1`"""

import sys

from realcore.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
