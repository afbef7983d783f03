# report.sh: sourced by the MPI test scripts: ok / fail lines and their counts.
#   ok WHAT                 counts a passed check
#   fail WHAT [FILE...]     counts a failed one and shows the start of each non-empty FILE
passed=0
failed=0
ok() { echo "ok   - $1"; passed=$((passed + 1)); }
fail() {
  echo "FAIL - $1"
  shift
  for f in "$@"; do [ -s "$f" ] && sed 's/^/       | /' "$f" | head -40; done
  failed=$((failed + 1))
}
