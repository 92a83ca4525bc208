"""`python -m dspark_hf.training train ...` / `... data generate ...` (also under `accelerate launch`)."""

import sys

from .commands import main

sys.exit(main())
