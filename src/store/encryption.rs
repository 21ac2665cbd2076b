//! Client-side encryption of snapshot payloads: each payload is an age file (X25519 recipients,
//! the STREAM payload: 64 KiB chunks, each authenticated, the last one marked as last), written
//! after compression, so the standard `age` tool decrypts it and a truncated or altered object
//! fails to decrypt instead of restoring something else.
//!
//! Writing needs only public keys: a sidecar that is compromised cannot read the backups it
//! (or anyone else) wrote. Reading needs an identity (a private key file).

use std::io::{self, BufWriter, Read, Write};

use super::compression::{ByteStream, blocking_pipe, blocking_transform};
use crate::config::KeyError;

/// Why a snapshot cannot be encrypted or decrypted; each names the snapshot.
#[derive(Debug, thiserror::Error)]
pub enum EncryptionError {
    /// A key file could not be read, so the snapshot is neither written nor read (it is never
    /// written in clear instead).
    #[error("{snapshot}: {source}")]
    Key {
        /// The snapshot's name.
        snapshot: String,
        #[source]
        source: KeyError,
    },
    /// The snapshot is encrypted and no identity is configured to read it.
    #[error(
        "{snapshot} is encrypted and no identity is configured to decrypt it: set \
         encryption.identities (ETCD_WARDEN_ENCRYPTION_IDENTITIES) to a private key file of one \
         of its recipients"
    )]
    NoIdentity {
        /// The snapshot's name.
        snapshot: String,
    },
    /// No configured identity opens the snapshot's header, or the header is damaged.
    #[error("{snapshot} cannot be decrypted with the identities in {files}: {reason}")]
    Undecryptable {
        /// The snapshot's name.
        snapshot: String,
        /// The identity files tried.
        files: String,
        /// Age's reason.
        reason: String,
    },
    /// The store encrypts but no recipient is left (every recipients file is empty).
    #[error("{snapshot}: encryption is configured but no recipient is (encryption.recipients)")]
    NoRecipient {
        /// The snapshot's name.
        snapshot: String,
    },
}

/// How every age file begins (the version line of its header).
pub const AGE_MAGIC: &[u8] = b"age-encryption.org/v1\n";
/// Bytes of an object enough to hold its age header (a few hundred bytes per recipient) and the
/// payload nonce: what [`check_header`] needs.
pub const HEADER_PROBE: usize = 16 << 10;
/// The buffer between the encryptor and the output channel: one output chunk.
const OUT_CHUNK: usize = 256 << 10;
/// Chunks queued on each side of the encrypting thread.
const DEPTH: usize = 2;

/// Encrypts `input` to every recipient on a blocking thread. Memory stays flat: one STREAM chunk,
/// one output buffer and a few queued chunks, whatever the payload's size.
pub fn encrypt(input: ByteStream, recipients: Vec<age::x25519::Recipient>) -> ByteStream {
    blocking_pipe(input, DEPTH, move |plain, out| {
        let mut sealed =
            encryptor(&recipients)?.wrap_output(BufWriter::with_capacity(OUT_CHUNK, out))?;
        copy_large(plain, &mut sealed)?;
        sealed.finish()?.flush()
    })
}

/// Encrypts a small payload in memory, as [`encrypt`] would stream it.
pub fn encrypt_bytes(plain: &[u8], recipients: &[age::x25519::Recipient]) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(plain.len() + 1024);
    let mut sealed = encryptor(recipients)?.wrap_output(&mut out)?;
    sealed.write_all(plain)?;
    sealed.finish()?;
    Ok(out)
}

fn encryptor(recipients: &[age::x25519::Recipient]) -> io::Result<age::Encryptor> {
    age::Encryptor::with_recipients(recipients.iter().map(|r| r as &dyn age::Recipient))
        .map_err(|e| io::Error::other(format!("cannot encrypt: {e}")))
}

/// Decrypts an age file with the first identity that unwraps it, on a blocking thread. A header
/// no identity opens, a chunk that fails its authentication, or a file that ends before its last
/// chunk ends the stream with an `InvalidData` error.
pub fn decrypt(input: ByteStream, identities: Vec<age::x25519::Identity>) -> ByteStream {
    blocking_transform(input, move |encrypted| {
        let opened =
            age::Decryptor::new_buffered(io::BufReader::with_capacity(64 << 10, encrypted))
                .and_then(|d| d.decrypt(identities.iter().map(|i| i as &dyn age::Identity)));
        match opened {
            Ok(reader) => Box::new(AuthReader(reader)),
            Err(e) => Box::new(Failed(Some(decrypt_error(e)))),
        }
    })
}

/// Whether the first identity that matches opens the header in `head` (an object's first bytes,
/// at least its header and nonce): the check that fails before anything is restored.
pub fn check_header(
    head: &[u8],
    identities: &[age::x25519::Identity],
) -> Result<(), age::DecryptError> {
    age::Decryptor::new_buffered(head)?
        .decrypt(identities.iter().map(|i| i as &dyn age::Identity))
        .map(drop)
}

/// Whether a payload starts as an age file does (what the copy job checks without a key).
pub fn looks_encrypted(head: &[u8]) -> bool {
    head.starts_with(AGE_MAGIC)
}

/// A decryption failure as the stream reports it: invalid data, with age's reason.
fn decrypt_error(e: age::DecryptError) -> io::Error {
    match e {
        age::DecryptError::Io(e) if e.kind() != io::ErrorKind::InvalidData => e,
        age::DecryptError::NoMatchingKeys => io::Error::new(
            io::ErrorKind::InvalidData,
            "no configured identity can decrypt it (encrypted to other keys)",
        ),
        other => io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a valid age file: {other}"),
        ),
    }
}

/// The STREAM reader's errors marked as what they are: a payload that failed authentication.
struct AuthReader<R>(R);

impl<R: Read> Read for AuthReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf).map_err(|e| {
            if e.kind() == io::ErrorKind::InvalidData || e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the encrypted payload failed authentication (truncated or altered): {e}"
                    ),
                )
            } else {
                e
            }
        })
    }
}

/// A reader that fails once with the error it holds.
struct Failed(Option<io::Error>);

impl Read for Failed {
    fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        Err(self
            .0
            .take()
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "decryption failed")))
    }
}

/// `io::copy` with a buffer of the STREAM chunk size, so each write seals a whole chunk.
fn copy_large(from: &mut dyn Read, to: &mut dyn Write) -> io::Result<u64> {
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::compression::{chunked, collect};
    use bytes::Bytes;
    use futures::StreamExt;

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[tokio::test]
    async fn round_trips_with_either_of_two_recipients_and_not_a_third() {
        let (a, b, c) = (
            age::x25519::Identity::generate(),
            age::x25519::Identity::generate(),
            age::x25519::Identity::generate(),
        );
        // Sizes around the 64 KiB STREAM chunk and the output buffer.
        for len in [0, 1, 65_535, 65_536, 65_537, 300_000, 1 << 20] {
            let plain = payload(len);
            let sealed = collect(encrypt(
                chunked(&plain, 10_000),
                vec![a.to_public(), b.to_public()],
            ))
            .await
            .unwrap();
            assert!(looks_encrypted(&sealed), "{len}");
            assert!(
                check_header(
                    &sealed[..sealed.len().min(HEADER_PROBE)],
                    std::slice::from_ref(&b)
                )
                .is_ok()
            );
            for id in [&a, &b] {
                let back = collect(decrypt(chunked(&sealed, 7_000), vec![id.clone()]))
                    .await
                    .unwrap();
                assert_eq!(back.len(), plain.len(), "{len}");
                assert!(back[..] == plain[..], "{len}");
            }
            let e = collect(decrypt(chunked(&sealed, 7_000), vec![c.clone()]))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("no configured identity"), "{e}");
            assert!(matches!(
                check_header(&sealed, std::slice::from_ref(&c)),
                Err(age::DecryptError::NoMatchingKeys)
            ));
        }
    }

    #[tokio::test]
    async fn every_flipped_byte_and_every_truncation_fails() {
        let id = age::x25519::Identity::generate();
        let plain = payload(150_000);
        let sealed = encrypt_bytes(&plain, &[id.to_public()]).unwrap();
        let streamed = collect(encrypt(chunked(&plain, 4096), vec![id.to_public()]))
            .await
            .unwrap();
        // Each file has its own header (a random ephemeral key, and age's random "grease"
        // stanza), so only the payload's length is common.
        let id_back = collect(decrypt(chunked(&streamed, 9_000), vec![id.clone()]))
            .await
            .unwrap();
        assert!(id_back[..] == plain[..]);
        // Every byte of the header and nonce, and a spread over the payload's chunks and tags.
        let header_end = sealed.len() - (plain.len() + 3 * 16);
        let positions = (0..header_end).chain((header_end..sealed.len()).step_by(997));
        for at in positions.chain([sealed.len() - 1]) {
            let mut bad = sealed.clone();
            bad[at] ^= 0x20;
            let got = collect(decrypt(chunked(&bad, 50_000), vec![id.clone()])).await;
            assert!(
                got.is_err(),
                "flipping byte {at} of {} went unnoticed",
                sealed.len()
            );
        }
        for len in [
            0,
            10,
            header_end,
            header_end + 100,
            65_536 + header_end + 16,
            sealed.len() - 1,
        ] {
            let got = collect(decrypt(chunked(&sealed[..len], 50_000), vec![id.clone()])).await;
            assert!(got.is_err(), "truncation to {len} went unnoticed");
        }
    }

    #[tokio::test]
    async fn an_input_error_is_never_sealed_as_a_complete_file() {
        let id = age::x25519::Identity::generate();
        let input = futures::stream::iter(vec![
            Ok(Bytes::from(payload(100_000))),
            Err(io::Error::other("etcd went away")),
        ])
        .boxed();
        let e = collect(encrypt(input, vec![id.to_public()]))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("etcd went away"), "{e}");
    }
}
