"""``python -m tests.corpus``: the corpus matrix's table of outcomes (see :mod:`.report`)."""

import sys

from tests.corpus.report import main

sys.exit(main())
