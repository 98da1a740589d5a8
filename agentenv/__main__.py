import sys

from agentenv.cli import main

sys.exit(main())
