from echo2.cli import main

raise SystemExit(main())
