#!/usr/bin/env bash
# Package the AWCP skill module (skill/awcp: SKILL.md and its scripts) for Delegator agents.
# Usage: scripts/package-skill.sh [OUT.tar.gz]   (default target/skill/awcp-skill.tar.gz)
# The archive holds one top-level directory, awcp/, and is reproducible (sorted names, fixed
# times and owners), so the same sources give the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/skill/awcp-skill.tar.gz}
src=skill/awcp
# The skill must say what it is: a SKILL.md with name and description in its front matter.
head -n 1 "$src/SKILL.md" | grep -qx -- '---' \
  || { echo "error: $src/SKILL.md must start with a --- front matter block" >&2; exit 1; }
for field in name description; do
  sed -n '2,/^---$/p' "$src/SKILL.md" | grep -q "^$field:" \
    || { echo "error: $src/SKILL.md front matter has no $field:" >&2; exit 1; }
done
for s in "$src"/scripts/*.sh; do
  bash -n "$s" || { echo "error: $s does not parse" >&2; exit 1; }
done
mkdir -p "$(dirname "$out")"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
  -C skill -cf - awcp | gzip -n > "$out"
echo "$out"
