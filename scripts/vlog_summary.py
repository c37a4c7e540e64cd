"""Count XLA command-buffer VLOG lines per execution (the markers diag_cmdbuf.py seq prints).

    python scripts/vlog_summary.py LOG [top]

Lines are normalised (numbers and addresses to '#') and counted between each
'===== ... begins' and '... ends' marker pair; the top lines per execution print.
"""

import collections
import re
import sys


def main(path, top=8):
  seg, counts = None, collections.Counter()
  for line in open(path, errors="replace"):
    if line.startswith("===== "):
      if "begins" in line:
        seg, counts = line[6:].split(" begins")[0], collections.Counter()
      elif "ends" in line and seg is not None:
        total = sum(counts.values())
        print(f"--- {line[6:].strip()}  ({total} vlog lines)")
        for text, c in counts.most_common(top):
          print(f"   {c:5d}  {text}")
        seg = None
      continue
    if seg is None:
      continue
    text = re.sub(r"^\S+ \S+ +\d+ \S+\] ", "", line.strip())   # glog prefix
    text = re.sub(r"0x[0-9a-f]+|\d+", "#", text)[:110]
    counts[text] += 1


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
