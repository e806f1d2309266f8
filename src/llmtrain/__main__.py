"""``python -m llmtrain ...``: the same as the ``llmtrain`` command."""

import sys

from llmtrain.cli import main

sys.exit(main())
