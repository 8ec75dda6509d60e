//! git's index file (`.git/index`, versions 2–4), read far enough to give it a filesystem
//! monitor extension of the mount's own.
//!
//! git trusts an entry without `lstat`ing it only when the index carries an `FSMN`
//! extension (a token, and a bitmap of the entries *not* known to be unchanged) and the
//! monitor answers that token. An index the Delegator's git wrote has none, or one whose
//! token no monitor here can answer: the first `git status` on every new mount then looks
//! at every file, one FUSE round trip each. The mount instead shows git an index whose
//! extension it wrote itself ([`with_fsmonitor`]): its own token, and as dirty every entry
//! whose recorded stat data does not match what the mount shows (`mount/prime.rs` decides).
//! Nothing else changes: the entries are kept byte for byte, and so is every other
//! extension but three that the new one would make stale:
//! * `UNTR`, the untracked cache: git trusts its directories wholesale once a monitor
//!   answers, and they describe the tree when the cache was written, not now. It is
//!   dropped, or rewritten ([`rewrite_untracked`]) with only the directories known
//!   unchanged still valid.
//! * `EOIE` and `IEOT`, the offsets for loading an index on several threads: the first
//!   holds a hash of the extension headers. Without them git reads the index on one thread.
//!
//! The format: a 12-byte header (`DIRC`, version, entry count), the entries, the
//! extensions (a 4-byte signature, a 32-bit size, the data), and a checksum of everything
//! before it — SHA-1, or SHA-256 in a repository of that object format, or zeros when
//! git was told to skip it (`index.skipHash`). See git's `Documentation/gitformat-index.txt`.

use std::ops::Range;

use sha1::Digest as _;

/// Extensions the monitor's own makes stale (see the module docs), dropped with it.
const DROPPED: [&[u8; 4]; 4] = [b"FSMN", b"UNTR", b"EOIE", b"IEOT"];

/// Why an index was not read (the mount then shows it unchanged).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    /// Not an index file.
    #[error("not a git index (no DIRC header)")]
    NotIndex,
    /// A version this reader does not know.
    #[error("index version {0} is not supported")]
    Version(u32),
    /// The checksum matches neither object format's.
    #[error("the index's checksum does not match its content")]
    Checksum,
    /// The entries or extensions run past the end or break the format.
    #[error("the index is malformed: {0}")]
    Malformed(&'static str),
    /// A split or sparse index, whose entries are not all in this file.
    #[error("a split or sparse index is left as it is")]
    Split,
}

/// One entry's fields the monitor's decision needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Where its path is in [`Index::names`].
    pub name: Range<usize>,
    /// Mode as git records it (`0o100644`, `0o100755`, `0o120000`, `0o160000`).
    pub mode: u32,
    /// Modification time recorded: seconds and nanoseconds.
    pub mtime: (u32, u32),
    /// Size recorded (the low 32 bits).
    pub size: u32,
    /// Merge stage (0 unless in a conflict).
    pub stage: u8,
    /// git must look at this one itself: assume-unchanged, skip-worktree or intent-to-add.
    pub special: bool,
}

/// A parsed index.
#[derive(Debug)]
pub struct Index {
    /// Format version (2, 3 or 4).
    pub version: u32,
    /// The object format's hash length: 20 (SHA-1) or 32 (SHA-256).
    pub hash_len: usize,
    /// The entries, in the index's (path) order.
    pub entries: Vec<Entry>,
    /// Every entry's path, one after the other.
    pub names: Vec<u8>,
    /// Where the entries end (the first extension, or the checksum).
    entries_end: usize,
    /// Each extension's bytes (header included) and signature.
    extensions: Vec<([u8; 4], Range<usize>)>,
    /// The checksum is zeros (`index.skipHash`).
    skip_hash: bool,
}

impl Index {
    /// An entry's path.
    pub fn path(&self, e: &Entry) -> &[u8] {
        &self.names[e.name.clone()]
    }

    /// An index of `entries` (paths in `names`), for tests of what reads it.
    #[cfg(test)]
    pub(crate) fn for_tests(entries: Vec<Entry>, names: Vec<u8>) -> Index {
        Index {
            version: 2,
            hash_len: 20,
            entries,
            names,
            entries_end: 12,
            extensions: Vec::new(),
            skip_hash: false,
        }
    }

    /// The untracked cache's data (`UNTR`), if the index has one.
    pub fn untracked<'a>(&self, data: &'a [u8]) -> Option<&'a [u8]> {
        let (_, r) = self.extensions.iter().find(|(sig, _)| sig == b"UNTR")?;
        Some(&data[r.start + 8..r.end])
    }

    /// The token of the monitor extension the index carries, if any.
    pub fn fsmonitor_token<'a>(&self, data: &'a [u8]) -> Option<&'a str> {
        let (_, r) = self.extensions.iter().find(|(sig, _)| sig == b"FSMN")?;
        let body = &data[r.start + 8..r.end];
        if body.get(..4)? != 2u32.to_be_bytes() {
            return None;
        }
        let rest = &body[4..];
        let nul = rest.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&rest[..nul]).ok()
    }
}

fn be32(b: &[u8], at: usize) -> Result<u32, IndexError> {
    b.get(at..at + 4)
        .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(IndexError::Malformed("truncated"))
}

fn be16(b: &[u8], at: usize) -> Result<u16, IndexError> {
    b.get(at..at + 2)
        .map(|s| u16::from_be_bytes([s[0], s[1]]))
        .ok_or(IndexError::Malformed("truncated"))
}

/// Read `data` as an index.
pub fn parse(data: &[u8]) -> Result<Index, IndexError> {
    if data.len() < 12 || &data[..4] != b"DIRC" {
        return Err(IndexError::NotIndex);
    }
    let version = be32(data, 4)?;
    if !(2..=4).contains(&version) {
        return Err(IndexError::Version(version));
    }
    // The checksum tells the object format: SHA-1's, else SHA-256's.
    let mut found = Err(IndexError::Checksum);
    for hash_len in [20, 32] {
        if data.len() < 12 + hash_len {
            continue;
        }
        let (body, sum) = data.split_at(data.len() - hash_len);
        let skip_hash = sum.iter().all(|&b| b == 0);
        let matches = skip_hash || checksum(body, hash_len) == sum;
        if !matches {
            continue;
        }
        found = parse_body(body, version, hash_len, skip_hash);
        if found.is_ok() || !skip_hash {
            break;
        }
    }
    found
}

fn checksum(body: &[u8], hash_len: usize) -> Vec<u8> {
    if hash_len == 20 {
        sha1::Sha1::digest(body).to_vec()
    } else {
        use sha2::Digest as _;
        sha2::Sha256::digest(body).to_vec()
    }
}

/// git's variable-length integer (index version 4's name compression).
fn varint(b: &[u8], at: &mut usize) -> Result<usize, IndexError> {
    let bad = IndexError::Malformed("bad name compression");
    let mut c = *b.get(*at).ok_or(IndexError::Malformed("truncated"))?;
    *at += 1;
    let mut val = u64::from(c & 127);
    while c & 128 != 0 {
        val = val.checked_add(1).ok_or(IndexError::Malformed("varint"))?;
        if val >> 57 != 0 {
            return Err(bad);
        }
        c = *b.get(*at).ok_or(IndexError::Malformed("truncated"))?;
        *at += 1;
        val = (val << 7) + u64::from(c & 127);
    }
    usize::try_from(val).map_err(|_| bad)
}

fn parse_body(
    body: &[u8],
    version: u32,
    hash_len: usize,
    skip_hash: bool,
) -> Result<Index, IndexError> {
    let count = be32(body, 8)? as usize;
    // Each entry takes at least 40 + hash + 2 + 1 bytes: a count past that is a lie.
    if count > body.len() / (43 + hash_len) {
        return Err(IndexError::Malformed("more entries than bytes"));
    }
    let mut entries = Vec::with_capacity(count);
    let mut names: Vec<u8> = Vec::new();
    let mut prev = 0..0;
    let mut pos = 12;
    for _ in 0..count {
        let at = pos;
        let flags_at = at + 40 + hash_len;
        let flags = be16(body, flags_at)?;
        let extended = flags & 0x4000 != 0;
        let mut p = flags_at + 2;
        let mut special = flags & 0x8000 != 0;
        if extended {
            if version < 3 {
                return Err(IndexError::Malformed("extended flags before version 3"));
            }
            let flags2 = be16(body, p)?;
            // skip-worktree, intent-to-add.
            special |= flags2 & 0x6000 != 0;
            p += 2;
        }
        let start = names.len();
        if version == 4 {
            let strip = varint(body, &mut p)?;
            let keep = prev
                .len()
                .checked_sub(strip)
                .ok_or(IndexError::Malformed("bad name compression"))?;
            let nul = body
                .get(p..)
                .and_then(|r| r.iter().position(|&b| b == 0))
                .ok_or(IndexError::Malformed("unterminated name"))?;
            names.extend_from_within(prev.start..prev.start + keep);
            names.extend_from_slice(&body[p..p + nul]);
            pos = p + nul + 1;
        } else {
            let len = usize::from(flags & 0xfff);
            let len = if len < 0xfff {
                len
            } else {
                body.get(p..)
                    .and_then(|r| r.iter().position(|&b| b == 0))
                    .ok_or(IndexError::Malformed("unterminated name"))?
            };
            let name = body
                .get(p..p + len)
                .ok_or(IndexError::Malformed("truncated"))?;
            names.extend_from_slice(name);
            let fixed = 40 + hash_len + if extended { 4 } else { 2 };
            pos = at + ((fixed + len + 8) & !7);
            if pos > body.len() || body.get(p + len) != Some(&0) {
                return Err(IndexError::Malformed("truncated"));
            }
        }
        prev = start..names.len();
        entries.push(Entry {
            name: prev.clone(),
            mtime: (be32(body, at + 8)?, be32(body, at + 12)?),
            mode: be32(body, at + 24)?,
            size: be32(body, at + 36)?,
            stage: ((flags >> 12) & 3) as u8,
            special,
        });
    }
    let entries_end = pos;
    let mut extensions = Vec::new();
    while pos < body.len() {
        let sig: [u8; 4] = body
            .get(pos..pos + 4)
            .and_then(|s| s.try_into().ok())
            .ok_or(IndexError::Malformed("truncated extension"))?;
        let size = be32(body, pos + 4)? as usize;
        let end = (pos + 8)
            .checked_add(size)
            .filter(|&e| e <= body.len())
            .ok_or(IndexError::Malformed("extension runs past the end"))?;
        if &sig == b"link" || &sig == b"sdir" {
            return Err(IndexError::Split);
        }
        extensions.push((sig, pos..end));
        pos = end;
    }
    Ok(Index {
        version,
        hash_len,
        entries,
        names,
        entries_end,
        extensions,
        skip_hash,
    })
}

/// `data` (the index `index` was read from) with the monitor extension `token` in place of
/// any it had, marking as dirty the entries `dirty` says, and without the extensions that
/// would be stale beside it (see the module docs); checksummed as the original was.
///
/// `untracked`, when given, is the untracked cache to keep in place of the one the index had
/// (see [`rewrite_untracked`]).
pub fn with_fsmonitor(
    data: &[u8],
    index: &Index,
    token: &str,
    mut dirty: impl FnMut(usize) -> bool,
    untracked: Option<&[u8]>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + index.entries.len() / 8 + 64);
    out.extend_from_slice(&data[..index.entries_end]);
    for (sig, r) in &index.extensions {
        if !DROPPED.contains(&sig) {
            out.extend_from_slice(&data[r.clone()]);
        }
    }
    if let Some(body) = untracked {
        out.extend_from_slice(b"UNTR");
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(body);
    }
    let marked: Vec<usize> = (0..index.entries.len()).filter(|&i| dirty(i)).collect();
    let mut ext = Vec::new();
    ext.extend_from_slice(&2u32.to_be_bytes());
    ext.extend_from_slice(token.as_bytes());
    ext.push(0);
    let bitmap = ewah(&marked);
    ext.extend_from_slice(&(bitmap.len() as u32).to_be_bytes());
    ext.extend_from_slice(&bitmap);
    out.extend_from_slice(b"FSMN");
    out.extend_from_slice(&(ext.len() as u32).to_be_bytes());
    out.extend_from_slice(&ext);
    if index.skip_hash {
        out.resize(out.len() + index.hash_len, 0);
    } else {
        let sum = checksum(&out, index.hash_len);
        out.extend_from_slice(&sum);
    }
    out
}

/// Where a stat record's mtime is (`struct stat_data`: ctime, mtime, dev, ino, uid, gid,
/// size; 36 bytes).
const STAT_DATA: usize = 36;

/// One directory of the untracked cache, as read.
struct UntrackedDir {
    /// Its name (empty for the work tree's root).
    name: Range<usize>,
    /// The untracked names it lists.
    untracked: Vec<Range<usize>>,
    /// How many subdirectories follow it (depth first).
    dirs: usize,
    /// Its path from the work tree's root, with a trailing `/` (empty for the root).
    path: Vec<u8>,
}

/// The untracked cache's data `body` (of an index whose object format hashes are
/// `hash_len` bytes) made fit for a monitor that answers only changes after now, for the
/// work tree `ident` names (git's `Location <work tree>, system <kernel>`): every
/// directory it calls valid stays so only if `keep(path, recorded mtime)` says its
/// recorded modification time is still the directory's — git then trusts its listing
/// without reading the directory — and the others are marked invalid, their listing
/// dropped, as git itself does when it finds a directory changed. The rest is kept.
pub fn rewrite_untracked(
    body: &[u8],
    hash_len: usize,
    ident: &str,
    mut keep: impl FnMut(&[u8], (u32, u32)) -> bool,
) -> Result<Vec<u8>, IndexError> {
    let bad = |what| IndexError::Malformed(what);
    let mut p = 0;
    let ident_len = varint(body, &mut p)?;
    p = p.checked_add(ident_len).ok_or(bad("untracked cache"))?;
    let fixed_start = p;
    // Two stat records (info/exclude, core.excludesFile), the flags, their two hashes.
    p += 2 * STAT_DATA + 4 + 2 * hash_len;
    let nul = body
        .get(p..)
        .and_then(|r| r.iter().position(|&b| b == 0))
        .ok_or(bad("untracked cache"))?;
    p += nul + 1;
    let fixed = fixed_start..p;
    let mut out = Vec::with_capacity(body.len());
    let mut ident_bytes = ident.as_bytes().to_vec();
    ident_bytes.push(0);
    put_varint(&mut out, ident_bytes.len());
    out.extend_from_slice(&ident_bytes);
    out.extend_from_slice(&body[fixed]);
    let count = varint(body, &mut p)?;
    if count == 0 {
        put_varint(&mut out, 0);
        return Ok(out);
    }
    if count > body.len() {
        return Err(bad("untracked cache"));
    }
    // The directories, depth first: each names how many subdirectories follow it.
    let mut dirs: Vec<UntrackedDir> = Vec::with_capacity(count);
    // (path, subdirectories still to read) of the directories being read.
    let mut open: Vec<(Vec<u8>, usize)> = Vec::new();
    for i in 0..count {
        let n_untracked = varint(body, &mut p)?;
        let n_dirs = varint(body, &mut p)?;
        let mut cstr = || -> Result<Range<usize>, IndexError> {
            let len = body
                .get(p..)
                .and_then(|r| r.iter().position(|&b| b == 0))
                .ok_or(bad("untracked cache"))?;
            let r = p..p + len;
            p += len + 1;
            Ok(r)
        };
        let name = cstr()?;
        if n_untracked > body.len() {
            return Err(bad("untracked cache"));
        }
        let untracked = (0..n_untracked).map(|_| cstr()).collect::<Result<_, _>>()?;
        while open.last().is_some_and(|(_, left)| *left == 0) {
            open.pop();
        }
        let path = match open.last_mut() {
            None if i == 0 => Vec::new(),
            None => return Err(bad("untracked cache tree")),
            Some((parent, left)) => {
                *left -= 1;
                let mut path = parent.clone();
                path.extend_from_slice(&body[name.clone()]);
                path.push(b'/');
                path
            }
        };
        open.push((path.clone(), n_dirs));
        dirs.push(UntrackedDir {
            name,
            untracked,
            dirs: n_dirs,
            path,
        });
    }
    let bitmap = |p: &mut usize| -> Result<Vec<usize>, IndexError> {
        let (bits, used) = ewah_bits(body.get(*p..).ok_or(bad("untracked cache"))?, count)?;
        *p += used;
        Ok(bits)
    };
    let valid = bitmap(&mut p)?;
    let check_only = bitmap(&mut p)?;
    let sha1_valid = bitmap(&mut p)?;
    if valid
        .iter()
        .chain(&check_only)
        .chain(&sha1_valid)
        .any(|&i| i >= count)
    {
        return Err(bad("untracked cache bitmap"));
    }
    let stats = p..p + valid.len() * STAT_DATA;
    let hashes = stats.end..stats.end + sha1_valid.len() * hash_len;
    if body.get(hashes.end) != Some(&0) {
        return Err(bad("untracked cache"));
    }
    let mut still_valid = Vec::with_capacity(valid.len());
    let mut kept_stats = Vec::with_capacity(stats.len());
    for (k, &i) in valid.iter().enumerate() {
        let stat = &body[stats.start + k * STAT_DATA..stats.start + (k + 1) * STAT_DATA];
        let mtime = (be32(stat, 8)?, be32(stat, 12)?);
        if keep(&dirs[i].path, mtime) {
            still_valid.push(i);
            kept_stats.extend_from_slice(stat);
        }
    }
    let is_valid = |i: usize| still_valid.binary_search(&i).is_ok();
    put_varint(&mut out, count);
    for (i, d) in dirs.iter().enumerate() {
        let listed: &[Range<usize>] = if is_valid(i) { &d.untracked } else { &[] };
        put_varint(&mut out, listed.len());
        put_varint(&mut out, d.dirs);
        out.extend_from_slice(&body[d.name.clone()]);
        out.push(0);
        for u in listed {
            out.extend_from_slice(&body[u.clone()]);
            out.push(0);
        }
    }
    let check_only: Vec<usize> = check_only.into_iter().filter(|&i| is_valid(i)).collect();
    out.extend_from_slice(&ewah(&still_valid));
    out.extend_from_slice(&ewah(&check_only));
    out.extend_from_slice(&ewah(&sha1_valid));
    out.extend_from_slice(&kept_stats);
    out.extend_from_slice(&body[hashes]);
    out.push(0);
    Ok(out)
}

/// git's variable-length integer, written.
fn put_varint(out: &mut Vec<u8>, value: usize) {
    let mut v = value as u64;
    let mut buf = [0u8; 16];
    let mut pos = buf.len() - 1;
    buf[pos] = (v & 127) as u8;
    loop {
        v >>= 7;
        if v == 0 {
            break;
        }
        v -= 1;
        pos -= 1;
        buf[pos] = 128 | (v & 127) as u8;
    }
    out.extend_from_slice(&buf[pos..]);
}

/// The bits set in git's serialized EWAH bitmap at the start of `b`, ascending, and how
/// many bytes it took; a bitmap of more than `max_bits` bits is refused.
fn ewah_bits(b: &[u8], max_bits: usize) -> Result<(Vec<usize>, usize), IndexError> {
    let bad = IndexError::Malformed("bitmap");
    let bit_size = be32(b, 0)? as usize;
    if bit_size > max_bits {
        return Err(IndexError::Malformed("bitmap longer than what it maps"));
    }
    let words = be32(b, 4)? as usize;
    let end = words
        .checked_mul(8)
        .and_then(|n| n.checked_add(12))
        .filter(|&e| e <= b.len())
        .ok_or(IndexError::Malformed("bitmap"))?;
    let word = |i: usize| u64::from_be_bytes(b[8 + 8 * i..16 + 8 * i].try_into().unwrap());
    let mut bits = Vec::new();
    let (mut i, mut pos) = (0usize, 0usize);
    while i < words {
        let rlw = word(i);
        let run = ((rlw >> 1) & 0xffff_ffff) as usize;
        let literals = (rlw >> 33) as usize;
        let run_bits = run.checked_mul(64).ok_or(IndexError::Malformed("bitmap"))?;
        if rlw & 1 == 1 {
            if pos + run_bits > bit_size + 64 {
                return Err(IndexError::Malformed("bitmap"));
            }
            bits.extend(pos..pos + run_bits);
        }
        pos = pos.saturating_add(run_bits);
        i += 1;
        if i + literals > words {
            return Err(bad);
        }
        for k in 0..literals {
            let w = word(i + k);
            for c in 0..64 {
                if w & (1 << c) != 0 {
                    bits.push(pos + c);
                }
            }
            pos += 64;
        }
        i += literals;
    }
    bits.retain(|&x| x < bit_size);
    Ok((bits, end))
}

/// The EWAH-compressed bitmap with the bits `set` (ascending), as git serializes it: the
/// bit count, the word count, the words, the position of the last run-length word. Here
/// one run-length word (no run, every following word literal) and the literal words: git
/// reads any valid encoding, and this one is never larger than the plain bitmap by more
/// than a word. The bit count ends at the last bit set (git refuses a bitmap longer than
/// the index).
fn ewah(set: &[usize]) -> Vec<u8> {
    let bits = set.last().map_or(0, |&last| last + 1);
    let mut words = vec![0u64; bits.div_ceil(64)];
    for &i in set {
        words[i / 64] |= 1 << (i % 64);
    }
    let mut out = Vec::with_capacity(12 + 8 * (words.len() + 1));
    out.extend_from_slice(&(bits as u32).to_be_bytes());
    out.extend_from_slice(&(words.len() as u32 + 1).to_be_bytes());
    // The run-length word: run bit 0, run length 0 (bits 1..33), literal words above.
    out.extend_from_slice(&((words.len() as u64) << 33).to_be_bytes());
    for w in &words {
        out.extend_from_slice(&w.to_be_bytes());
    }
    out.extend_from_slice(&0u32.to_be_bytes());
    out
}

#[cfg(test)]
mod tests;
