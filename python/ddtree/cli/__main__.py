"""`python -m ddtree.cli`: the ddtree command line."""
import sys

from . import main

sys.exit(main())
