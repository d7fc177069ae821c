"""`python -m kd_ckpt plan|inspect`: see `kd_ckpt.cli`."""

import sys

from kd_ckpt import cli

if __name__ == '__main__':
  sys.exit(cli.main())
