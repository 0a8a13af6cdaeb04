from fsdpdoctor.cli import main

main()
