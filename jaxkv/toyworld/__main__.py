import sys

from jaxkv.toyworld.cli import main

sys.exit(main())
