from rlnotes.cli import main
import sys
sys.exit(main())
