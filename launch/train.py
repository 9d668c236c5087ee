"""Train the GPT of a ds_recycle config; see ds_recycle/train/loop.py for the command lines."""
import sys

from ds_recycle.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
