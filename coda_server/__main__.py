"""`python -m coda_server` runs the server command line."""
import sys

from .cli import main

sys.exit(main())
