"""Convert a megaroute DeepSpeed checkpoint into a Hugging Face model directory.

    python launcher/convert_checkpoint.py runs/<name> hf/<name> [--tag step_00001000] [--force]
"""

import sys

from megaroute.hf.convert import main

if __name__ == "__main__":
    sys.exit(main())
