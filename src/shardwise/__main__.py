import sys

from shardwise.cli.main import main

sys.exit(main())
