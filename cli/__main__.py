import sys

from fedrl.cli.main import main

sys.exit(main())
