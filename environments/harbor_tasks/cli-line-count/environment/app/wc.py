"""Count the words, or with -l the lines, of a file."""

import sys


def main(argv):
    lines_only = argv[:1] == ["-l"]
    path = argv[-1]
    with open(path) as f:
        text = f.read()
    if lines_only:
        print(len(text.split("\n")))
    else:
        print(len(text.split()))


if __name__ == "__main__":
    main(sys.argv[1:])
