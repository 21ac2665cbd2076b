//! etcd-warden's gzip members: one per block of a gzip snapshot, each a complete gzip member
//! (RFC 1952) whose header says how long it is and what it inflates to, so a reader can cut the
//! file into members without inflating it and inflate several at once.
//!
//! A member's header is 24 bytes:
//!
//! ```text
//! 1f 8b 08 04 00 00 00 00 XFL ff | 0c 00 | 'E' 'W' 08 00 | STORED (u32 LE) | INFLATED (u32 LE)
//! magic, deflate, FEXTRA, mtime 0 | XLEN 12 | subfield "EW", 8 bytes | the subfield's data
//! ```
//!
//! then the raw deflate stream, then the usual trailer (CRC-32 and ISIZE, u32 LE each).
//! `STORED` is the member's whole length, header to trailer inclusive; `INFLATED` the bytes it
//! inflates to. `XFL` is 2 at the slowest level, 4 at the fastest, else 0 (as gzip and flate2
//! write it). The extra field is the one RFC 1952 keeps for this: every reader skips subfields it
//! does not know (GNU gzip, Go's `gzip.Reader` that etcd-backup-restore uses, flate2's
//! `MultiGzDecoder`), so a file of these members is still one ordinary gzip file. The id is not
//! BGZF's `BC` (whose 16-bit size a member of 1 MiB would not fit).
//!
//! Everything here is pure over byte slices: the streams that cut and inflate in parallel are
//! `compression`'s. What a hostile file can lie about is checked where it is read: a stated size
//! is capped before anything is allocated for it ([`MAX_INFLATED`], [`MAX_STORED`]), the stored
//! size must be where the deflate stream and its trailer actually end, and the inflated bytes must
//! match the stated size, the trailer's ISIZE and its CRC-32.

use std::io;

/// The subfield id in the FEXTRA field ("etcd-warden").
pub(super) const SUBFIELD_ID: [u8; 2] = *b"EW";
/// Length of the header etcd-warden writes.
pub(super) const HEADER_LEN: usize = 24;
/// CRC-32 and ISIZE.
const TRAILER_LEN: usize = 8;
/// The most a member may state it inflates to (etcd-warden writes 1 MiB): a larger statement is
/// an error, never an allocation.
pub(super) const MAX_INFLATED: u32 = 16 << 20;
/// The most a member may state it stores: deflate's worst case for [`MAX_INFLATED`] (stored blocks,
/// 5 bytes per 64 KiB), a header and a trailer, with room to spare.
pub(super) const MAX_STORED: u32 = MAX_INFLATED + (MAX_INFLATED >> 6) + 4096;

const FHCRC: u8 = 0x02;
const FEXTRA: u8 = 0x04;
const FNAME: u8 = 0x08;
const FCOMMENT: u8 = 0x10;
const FRESERVED: u8 = 0xe0;

/// What a member's header states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sizes {
    /// The whole member, header to trailer inclusive.
    pub stored: u32,
    /// What it inflates to.
    pub inflated: u32,
}

/// What the start of a member says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Head {
    /// Not enough bytes to tell: this many are needed.
    Short(usize),
    /// Not a gzip member (wrong magic or method).
    NotGzip,
    /// A gzip member without etcd-warden's subfield: only a sequential decoder can find its end.
    Unsized,
    /// etcd-warden's subfield, and where the extra field ends (the header is at least that long).
    Sized { sizes: Sizes, extra_end: usize },
}

/// Reads what the start of a member says, from as many bytes as are at hand.
pub(super) fn head(buf: &[u8]) -> Head {
    if buf.len() < 10 {
        return Head::Short(10);
    }
    if buf[..3] != [0x1f, 0x8b, 8] {
        return Head::NotGzip;
    }
    if buf[3] & FEXTRA == 0 {
        return Head::Unsized;
    }
    let Some(xlen) = buf.get(10..12) else {
        return Head::Short(12);
    };
    let extra_end = 12 + usize::from(u16::from_le_bytes([xlen[0], xlen[1]]));
    let Some(mut extra) = buf.get(12..extra_end) else {
        return Head::Short(extra_end);
    };
    while let [a, b, l0, l1, rest @ ..] = extra {
        let len = usize::from(u16::from_le_bytes([*l0, *l1]));
        let Some(data) = rest.get(..len) else {
            break;
        };
        if [*a, *b] == SUBFIELD_ID && len == 8 {
            let word =
                |i: usize| u32::from_le_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
            let sizes = Sizes {
                stored: word(0),
                inflated: word(4),
            };
            return Head::Sized { sizes, extra_end };
        }
        extra = &rest[len..];
    }
    Head::Unsized
}

fn invalid(offset: u64, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("gzip member at offset {offset}: {what}"),
    )
}

/// Checks what a header states before anything is read or allocated for it.
pub(super) fn check_sizes(sizes: Sizes, extra_end: usize, offset: u64) -> io::Result<()> {
    if sizes.inflated > MAX_INFLATED {
        return Err(invalid(
            offset,
            format!(
                "its header states {} bytes inflated, more than the {MAX_INFLATED} a member may",
                sizes.inflated
            ),
        ));
    }
    if sizes.stored > MAX_STORED {
        return Err(invalid(
            offset,
            format!(
                "its header states {} bytes stored, more than the {MAX_STORED} a member may",
                sizes.stored
            ),
        ));
    }
    // The smallest deflate stream is 2 bytes (an empty fixed block).
    let least = extra_end + 2 + TRAILER_LEN;
    if (sizes.stored as usize) < least {
        return Err(invalid(
            offset,
            format!(
                "its header states {} bytes stored, fewer than its own header and trailer ({least})",
                sizes.stored
            ),
        ));
    }
    Ok(())
}

/// The full length of a member's header (its optional name, comment and header CRC included).
fn header_len(member: &[u8], offset: u64) -> io::Result<usize> {
    let short = || invalid(offset, "its header runs past the member's stated size");
    let flg = *member.get(3).ok_or_else(short)?;
    if flg & FRESERVED != 0 {
        return Err(invalid(
            offset,
            format!("reserved header flags set ({flg:#04x})"),
        ));
    }
    let mut pos = 10;
    if flg & FEXTRA != 0 {
        let x = member.get(10..12).ok_or_else(short)?;
        pos = 12 + usize::from(u16::from_le_bytes([x[0], x[1]]));
    }
    for flag in [FNAME, FCOMMENT] {
        if flg & flag != 0 {
            let rest = member.get(pos..).ok_or_else(short)?;
            pos += 1 + rest.iter().position(|&b| b == 0).ok_or_else(short)?;
        }
    }
    if flg & FHCRC != 0 {
        let stated = member.get(pos..pos + 2).ok_or_else(short)?;
        let mut crc = flate2::Crc::new();
        crc.update(&member[..pos]);
        if u16::from_le_bytes([stated[0], stated[1]]) != crc.sum() as u16 {
            return Err(invalid(offset, "its header CRC does not match"));
        }
        pos += 2;
    }
    match pos <= member.len() {
        true => Ok(pos),
        false => Err(short()),
    }
}

/// Writes `block` as one member at `level`.
pub(super) fn write(block: &[u8], level: flate2::Compression) -> io::Result<Vec<u8>> {
    use std::io::Write;
    let too_large = || io::Error::other("a gzip member's block is larger than a member may hold");
    let inflated = u32::try_from(block.len()).map_err(|_| too_large())?;
    if inflated > MAX_INFLATED {
        return Err(too_large());
    }
    // Room for incompressible input (deflate's stored blocks add 5 bytes per 64 KiB), so the
    // buffer never doubles; the upload holds several of these at once.
    let mut out = Vec::with_capacity(HEADER_LEN + block.len() + block.len() / 1024 + 64);
    out.resize(HEADER_LEN, 0);
    let mut enc = flate2::write::DeflateEncoder::new(out, level);
    enc.write_all(block)?;
    let mut out = enc.finish()?;
    let mut crc = flate2::Crc::new();
    crc.update(block);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&inflated.to_le_bytes());
    let stored = u32::try_from(out.len()).map_err(|_| too_large())?;
    let xfl = match level.level() {
        l if l >= flate2::Compression::best().level() => 2,
        l if l <= flate2::Compression::fast().level() => 4,
        _ => 0,
    };
    let mut header = [0u8; HEADER_LEN];
    header[..12].copy_from_slice(&[0x1f, 0x8b, 8, FEXTRA, 0, 0, 0, 0, xfl, 0xff, 12, 0]);
    header[12..14].copy_from_slice(&SUBFIELD_ID);
    header[14..16].copy_from_slice(&8u16.to_le_bytes());
    header[16..20].copy_from_slice(&stored.to_le_bytes());
    header[20..24].copy_from_slice(&inflated.to_le_bytes());
    out[..HEADER_LEN].copy_from_slice(&header);
    Ok(out)
}

/// Inflates one whole member (exactly its stated stored size, which begins at `offset` in the
/// file: errors name it) into `out`, whose contents are overwritten (a reused buffer is not
/// cleared first) and which is left holding exactly the inflated bytes. Every statement the member makes is checked against what its bytes hold.
pub(super) fn inflate(member: &[u8], offset: u64, out: &mut Vec<u8>) -> io::Result<()> {
    let Head::Sized { sizes, extra_end } = head(member) else {
        return Err(invalid(
            offset,
            "no etcd-warden size subfield in its header",
        ));
    };
    check_sizes(sizes, extra_end, offset)?;
    if member.len() != sizes.stored as usize {
        return Err(invalid(
            offset,
            format!(
                "{} bytes handed over, its header states {}",
                member.len(),
                sizes.stored
            ),
        ));
    }
    let start = header_len(member, offset)?;
    let inflated = sizes.inflated as usize;
    // One byte more than stated, so a member that inflates to more is seen, not cut.
    out.resize(inflated + 1, 0);
    let mut d = flate2::Decompress::new(false);
    let status = d
        .decompress(&member[start..], out, flate2::FlushDecompress::Finish)
        .map_err(|e| invalid(offset, format!("corrupt deflate data: {e}")))?;
    let produced = d.total_out() as usize;
    if produced > inflated {
        return Err(invalid(
            offset,
            format!("inflates to more than the {inflated} bytes its header states"),
        ));
    }
    if status != flate2::Status::StreamEnd {
        return Err(invalid(
            offset,
            format!(
                "its deflate stream does not end within the {} bytes its header states \
                 (a stated size too small, or a cut member)",
                sizes.stored
            ),
        ));
    }
    if produced != inflated {
        return Err(invalid(
            offset,
            format!("inflates to {produced} bytes, its header states {inflated}"),
        ));
    }
    let end = start + d.total_in() as usize + TRAILER_LEN;
    if end != member.len() {
        return Err(invalid(
            offset,
            format!(
                "its deflate stream and trailer end after {end} bytes, its header states {}",
                sizes.stored
            ),
        ));
    }
    out.truncate(inflated);
    let t = &member[end - TRAILER_LEN..];
    let stated_crc = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
    let isize = u32::from_le_bytes([t[4], t[5], t[6], t[7]]);
    let mut crc = flate2::Crc::new();
    crc.update(out);
    if crc.sum() != stated_crc {
        return Err(invalid(
            offset,
            format!(
                "CRC-32 {:#010x} of the inflated bytes, its trailer states {stated_crc:#010x}",
                crc.sum()
            ),
        ));
    }
    if isize != sizes.inflated {
        return Err(invalid(
            offset,
            format!("its trailer states {isize} bytes inflated, its header {inflated}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 31) % 253) as u8 ^ (i >> 12) as u8)
            .collect()
    }

    fn member(len: usize) -> Vec<u8> {
        write(&sample(len), flate2::Compression::fast()).unwrap()
    }

    fn err(m: &[u8]) -> String {
        let mut out = Vec::new();
        inflate(m, 4096, &mut out).unwrap_err().to_string()
    }

    #[test]
    fn a_member_states_its_sizes_and_inflates_back() {
        for len in [0, 1, 1000, 1 << 20] {
            let m = member(len);
            let Head::Sized { sizes, extra_end } = head(&m) else {
                panic!("{len}: no sizes in {:?}", &m[..24]);
            };
            assert_eq!(sizes.stored as usize, m.len());
            assert_eq!(sizes.inflated as usize, len);
            assert_eq!(extra_end, HEADER_LEN);
            let mut out = vec![7; 3];
            inflate(&m, 0, &mut out).unwrap();
            assert!(out == sample(len), "{len}");
        }
    }

    /// The decision a reader makes from a file's first bytes: only etcd-warden's subfield,
    /// complete, makes a member cuttable.
    #[test]
    fn the_head_tells_sized_members_from_other_gzip() {
        let m = member(100);
        assert_eq!(head(&m[..5]), Head::Short(10));
        assert_eq!(head(&m[..11]), Head::Short(12));
        assert_eq!(head(&m[..20]), Head::Short(24));
        assert!(matches!(head(&m[..24]), Head::Sized { .. }));
        let mut plain = Vec::new();
        {
            use std::io::Write;
            let mut e = flate2::write::GzEncoder::new(&mut plain, flate2::Compression::fast());
            e.write_all(b"hello").unwrap();
            e.finish().unwrap();
        }
        assert_eq!(head(&plain), Head::Unsized);
        assert_eq!(head(b"not gzip at all"), Head::NotGzip);
        // Someone else's subfield, or ours at another length: a plain gzip member.
        let mut other = m.clone();
        other[12..14].copy_from_slice(b"BC");
        assert_eq!(head(&other), Head::Unsized);
        let mut long = m.clone();
        long[14] = 4;
        assert_eq!(head(&long), Head::Unsized);
        // A subfield after another one is found.
        let mut two = m[..10].to_vec();
        two.extend_from_slice(&[18, 0, b'X', b'Y', 2, 0, 1, 2]);
        two.extend_from_slice(&m[12..24]);
        assert!(matches!(head(&two), Head::Sized { extra_end: 30, .. }));
    }

    #[test]
    fn gnu_gzip_and_flate2_read_members() {
        use std::io::Read;
        let data = sample(300_000);
        let mut file = member(0);
        file.extend(write(&data, flate2::Compression::best()).unwrap());
        file.extend(member(5));
        let mut expect = data.clone();
        expect.extend(sample(5));
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&file[..])
            .read_to_end(&mut out)
            .unwrap();
        assert!(out == expect);
        let mut gz = std::process::Command::new("gzip")
            .args(["-d", "-c"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("GNU gzip on PATH");
        let mut stdin = gz.stdin.take().unwrap();
        let feeder = std::thread::spawn(move || {
            use std::io::Write;
            stdin.write_all(&file).unwrap();
        });
        let got = gz.wait_with_output().unwrap();
        feeder.join().unwrap();
        assert!(
            got.status.success(),
            "{}",
            String::from_utf8_lossy(&got.stderr)
        );
        assert!(got.stdout == expect);
    }

    #[test]
    fn every_lie_a_member_tells_is_an_error_naming_its_offset() {
        let m = member(50_000);
        let stored = m.len() as u32;
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut m = m.clone();
            f(&mut m);
            m
        };
        let set =
            |m: &mut Vec<u8>, at: usize, v: u32| m[at..at + 4].copy_from_slice(&v.to_le_bytes());
        // Stated too small: cut short of its deflate end.
        let small = with(&|m| {
            set(m, 16, stored - 20);
            m.truncate(stored as usize - 20);
        });
        assert!(
            err(&small).contains("does not end within"),
            "{}",
            err(&small)
        );
        // Stated too large: bytes after the trailer.
        let large = with(&|m| {
            set(m, 16, stored + 3);
            m.extend_from_slice(&[0, 0, 0]);
        });
        assert!(err(&large).contains("end after"), "{}", err(&large));
        // Handed a length other than the stated one.
        assert!(err(&m[..m.len() - 1]).contains("handed over"));
        let crc = with(&|m| {
            let at = m.len() - 8;
            m[at] ^= 1;
        });
        assert!(err(&crc).contains("CRC-32"), "{}", err(&crc));
        let isize = with(&|m| {
            let at = m.len() - 4;
            m[at] ^= 1;
        });
        assert!(err(&isize).contains("trailer states"), "{}", err(&isize));
        let fewer = with(&|m| set(m, 20, 49_999));
        assert!(
            err(&fewer).contains("more than the 49999"),
            "{}",
            err(&fewer)
        );
        let more = with(&|m| set(m, 20, 50_001));
        assert!(err(&more).contains("inflates to 50000"), "{}", err(&more));
        let huge = with(&|m| set(m, 20, u32::MAX));
        assert!(
            err(&huge).contains("4294967295 bytes inflated"),
            "{}",
            err(&huge)
        );
        let tiny = with(&|m| set(m, 16, 20));
        assert!(
            err(&tiny).contains("fewer than its own header"),
            "{}",
            err(&tiny)
        );
        let corrupt = with(&|m| m[40] ^= 0xff);
        assert!(err(&corrupt).contains("offset 4096"), "{}", err(&corrupt));
        let reserved = with(&|m| m[3] |= 0x80);
        assert!(err(&reserved).contains("reserved"), "{}", err(&reserved));
        // A name that never ends runs past the member.
        let name = with(&|m| m[3] |= FNAME);
        assert!(err(&name).contains("offset 4096"), "{}", err(&name));
    }
}
