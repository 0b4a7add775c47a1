import sys

from jmtp.cli import main

sys.exit(main())
