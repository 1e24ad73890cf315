"""`python -m clients` (from the repository root): an alias of the `gangserve` command of the
client distribution in this directory (`pip install ./clients`; import `gangserve_client`)."""
import sys

from gangserve_client.cli import main

sys.exit(main())
