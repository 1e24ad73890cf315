"""`python -m gangserve_client` = the `gangserve` command."""
import sys

from gangserve_client.cli import main

sys.exit(main())
