from dpmf.cli import main

raise SystemExit(main())
