from rlnotes.commands.cli import main
import sys
sys.exit(main())
