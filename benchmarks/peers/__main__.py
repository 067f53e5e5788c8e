from benchmarks.peers.driver import main

main()
