import sys

from meshlm.cli import main

sys.exit(main())
