import sys

from rlnotes.commands.cli import main

sys.exit(main())
