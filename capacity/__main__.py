from capacity.cli import main

main()
