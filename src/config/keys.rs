//! The `[encryption]` keys: age X25519 public keys that new snapshots are encrypted to, and the
//! private key files that read them back.
//!
//! Key files are read again on every use (a snapshot, a restore), so a rotated file takes effect
//! without a restart. A file that cannot be read or parsed is an error, never "no key": a sidecar
//! configured to encrypt must not fall back to writing plaintext.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The prefix of an age X25519 public key.
const RECIPIENT_PREFIX: &str = "age1";
/// The prefix of an age X25519 private key.
const IDENTITY_PREFIX: &str = "AGE-SECRET-KEY-1";

/// The `[encryption]` section, validated; the default (no keys) is the section's absence.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct EncryptionConfig {
    /// Public keys given inline (`encryption.recipients`).
    pub recipients: Vec<age::x25519::Recipient>,
    /// Files of public keys, one per line (`encryption.recipients_files`).
    pub recipients_files: Vec<PathBuf>,
    /// Files of private keys as `age-keygen` writes them (`encryption.identities`).
    pub identities: Vec<PathBuf>,
}

impl fmt::Debug for EncryptionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptionConfig")
            .field(
                "recipients",
                &self
                    .recipients
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>(),
            )
            .field("recipients_files", &self.recipients_files)
            .field("identities", &self.identities)
            .finish()
    }
}

/// Why a key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// A key file could not be read.
    #[error("cannot read key file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of a key file is not a key of the expected kind (the line itself is not shown:
    /// it may be a private key).
    #[error("{path}:{line}: not an age X25519 {what} ({prefix}…)")]
    Parse {
        path: PathBuf,
        line: usize,
        what: &'static str,
        prefix: &'static str,
    },
    /// A key file holds no key.
    #[error("{path}: no {what} in the file")]
    Empty { path: PathBuf, what: &'static str },
}

impl EncryptionConfig {
    /// Whether new snapshots are encrypted: some recipient is configured.
    pub fn encrypts(&self) -> bool {
        !self.recipients.is_empty() || !self.recipients_files.is_empty()
    }

    /// Every public key new snapshots go to: the inline ones and the files' as they are now.
    pub fn load_recipients(&self) -> Result<Vec<age::x25519::Recipient>, KeyError> {
        let mut all = self.recipients.clone();
        for path in &self.recipients_files {
            all.extend(read_keys(path, "public key", RECIPIENT_PREFIX)?);
        }
        Ok(all)
    }

    /// Every private key, read from the files as they are now.
    pub fn load_identities(&self) -> Result<Vec<age::x25519::Identity>, KeyError> {
        let mut all = Vec::new();
        for path in &self.identities {
            all.extend(read_keys(path, "private key", IDENTITY_PREFIX)?);
        }
        Ok(all)
    }
}

/// Parses one inline public key; the error says what one looks like (and never repeats a
/// private key pasted by mistake).
pub fn parse_recipient(text: &str) -> Result<age::x25519::Recipient, String> {
    age::x25519::Recipient::from_str(text.trim()).map_err(|_| {
        format!(
            "{} is not an age X25519 public key (\"{RECIPIENT_PREFIX}…\", as age-keygen -y prints)",
            shown(text)
        )
    })
}

/// Whether `text` holds an age private key (`AGE-SECRET-KEY-1…`; Bech32 is case-insensitive).
pub fn holds_private_key(text: &str) -> bool {
    text.to_ascii_uppercase().contains("AGE-SECRET-KEY-")
}

/// `text` quoted for an error message or a printed configuration, unless it holds a private
/// key: a key pasted where a public key or a path belongs must not reach logs.
pub fn shown(text: &str) -> String {
    if holds_private_key(text) {
        "(an age private key, not shown)".to_owned()
    } else {
        format!("{text:?}")
    }
}

/// The keys in a file: one per line, blank lines and `#` comments skipped (`age-keygen`'s
/// output and a recipients file both read this way). At least one key is required.
fn read_keys<K: FromStr>(
    path: &Path,
    what: &'static str,
    prefix: &'static str,
) -> Result<Vec<K>, KeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        keys.push(K::from_str(line).map_err(|_| KeyError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            what,
            prefix,
        })?);
    }
    if keys.is_empty() {
        return Err(KeyError::Empty {
            path: path.to_path_buf(),
            what,
        });
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use age::secrecy::ExposeSecret;

    fn config(dir: &Path, recipients: &str, identities: &str) -> EncryptionConfig {
        let r = dir.join("recipients.txt");
        let i = dir.join("identity.txt");
        std::fs::write(&r, recipients).unwrap();
        std::fs::write(&i, identities).unwrap();
        EncryptionConfig {
            recipients: vec![],
            recipients_files: vec![r],
            identities: vec![i],
        }
    }

    #[test]
    fn key_files_read_like_age_keygen_writes_them_and_again_on_every_use() {
        let dir = tempfile::tempdir().unwrap();
        let a = age::x25519::Identity::generate();
        let b = age::x25519::Identity::generate();
        let keygen = format!(
            "# created: 2026-11-23T10:00:00Z\n# public key: {}\n{}\n",
            a.to_public(),
            a.to_string().expose_secret()
        );
        let c = config(
            dir.path(),
            &format!("# team\n\n{}\n", a.to_public()),
            &keygen,
        );
        assert!(c.encrypts());
        assert_eq!(c.load_recipients().unwrap(), vec![a.to_public()]);
        assert_eq!(c.load_identities().unwrap().len(), 1);

        // Rotation: the files change, the next load sees the new keys.
        std::fs::write(
            &c.recipients_files[0],
            format!("{}\n{}\n", a.to_public(), b.to_public()),
        )
        .unwrap();
        assert_eq!(
            c.load_recipients().unwrap(),
            vec![a.to_public(), b.to_public()]
        );
    }

    #[test]
    fn bad_key_files_name_file_and_line_but_never_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let c = config(
            dir.path(),
            "age1notakey\n",
            "# c\nAGE-SECRET-KEY-1SECRETBUTBROKEN\n",
        );
        let e = c.load_recipients().unwrap_err().to_string();
        assert!(
            e.contains("recipients.txt:1") && e.contains("public key"),
            "{e}"
        );
        let e = c.load_identities().map(drop).unwrap_err().to_string();
        assert!(e.contains("identity.txt:2"), "{e}");
        assert!(
            !e.contains("SECRETBUTBROKEN"),
            "a private key line leaked: {e}"
        );

        let c = config(dir.path(), "# only a comment\n", "");
        assert!(
            c.load_recipients()
                .unwrap_err()
                .to_string()
                .contains("no public key")
        );
        let missing = EncryptionConfig {
            recipients: vec![],
            recipients_files: vec![],
            identities: vec![dir.path().join("absent")],
        };
        assert!(!missing.encrypts());
        assert!(matches!(
            missing.load_identities(),
            Err(KeyError::Read { .. })
        ));
        assert!(
            parse_recipient("age1xyz")
                .unwrap_err()
                .contains("age-keygen -y")
        );
    }
}
