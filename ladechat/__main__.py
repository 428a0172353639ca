from ladechat.cli import main

main()
