from zeroband.cli import main

raise SystemExit(main())
