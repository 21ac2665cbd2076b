//! One `impl ObjectStore` for a test's wrapper around a real store: the wrapper writes out the
//! methods it intercepts, and deleting, listing, copying and renaming pass through to the store
//! it wraps, so each wrapper states only what it changes.

/// `impl ObjectStore for $ty`: the methods in the braces as written, then `delete_stream`, `list`,
/// `list_with_delimiter`, `copy_opts` and `rename_opts` forwarded to `self.$inner`.
///
/// A macro rather than a generic pass-through type: `#[async_trait]` has to see every method of
/// the impl at once, and the wrappers intercept different methods with different state.
macro_rules! object_store_passing_the_rest {
    ($ty:ty, $inner:ident, { $($own:tt)* }) => {
        #[::async_trait::async_trait]
        impl ::object_store::ObjectStore for $ty {
            $($own)*

            fn delete_stream(
                &self,
                locations: ::futures::stream::BoxStream<
                    'static,
                    ::object_store::Result<::object_store::path::Path>,
                >,
            ) -> ::futures::stream::BoxStream<'static, ::object_store::Result<::object_store::path::Path>>
            {
                self.$inner.delete_stream(locations)
            }

            fn list(
                &self,
                prefix: Option<&::object_store::path::Path>,
            ) -> ::futures::stream::BoxStream<'static, ::object_store::Result<::object_store::ObjectMeta>>
            {
                self.$inner.list(prefix)
            }

            async fn list_with_delimiter(
                &self,
                prefix: Option<&::object_store::path::Path>,
            ) -> ::object_store::Result<::object_store::ListResult> {
                self.$inner.list_with_delimiter(prefix).await
            }

            async fn copy_opts(
                &self,
                from: &::object_store::path::Path,
                to: &::object_store::path::Path,
                options: ::object_store::CopyOptions,
            ) -> ::object_store::Result<()> {
                self.$inner.copy_opts(from, to, options).await
            }

            async fn rename_opts(
                &self,
                from: &::object_store::path::Path,
                to: &::object_store::path::Path,
                options: ::object_store::RenameOptions,
            ) -> ::object_store::Result<()> {
                self.$inner.rename_opts(from, to, options).await
            }
        }
    };
}

pub(crate) use object_store_passing_the_rest;
