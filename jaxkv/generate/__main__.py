"""``python -m jaxkv.generate`` (the same as ``jaxkv generate``)."""

import sys

from jaxkv.generate.loop import main

sys.exit(main())
