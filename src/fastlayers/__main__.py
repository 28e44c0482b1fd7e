"""``python -m fastlayers``: the ``fastlayers`` command (:mod:`fastlayers.cli`)."""

import sys

from .cli import main

sys.exit(main())
